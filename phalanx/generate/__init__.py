"""Generation with a KV cache from the training code's own model, in its parallel layout:
`decoding.generate_ids` (prefill, then one token per step), `sampling` (greedy, temperature,
top-k, top-p), `model_source` (a Hugging Face directory or a run), `cli` (`phalanx generate`).

Importing this package does not import torch.
"""
