"""Operator choices for inference on CPU, applied from outside the model: oneDNN's GEMM for the
linear layers and routed experts (`onednn_linear.py`) and the C kernel that reads decode
attention straight from the paged KV pool (`decode_kernel.py`, `decode_kernel.c`)."""
