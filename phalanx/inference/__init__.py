"""What generation and serving share, below `train/`, `generate/` and `serve/`: where a model
comes from (`model_source.py`: a preset, a Hugging Face directory or a run), the decoding loop
with a KV cache (`decoding.py`) and sampling settings and token choice (`sampling.py`)."""
