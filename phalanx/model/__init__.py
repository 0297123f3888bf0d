"""The single-device model: `transformer.py` (the decoder), its parts (attention, MoE, router,
norms, rotary, KV cache), and its shapes: `config.py` (ModelConfig, presets), `hf_config.py`
(a Hugging Face config.json read) and `by_name.py` (a `--model` value resolved), which need no
torch. Nothing here knows about meshes or ranks: parallelism is applied from outside."""
