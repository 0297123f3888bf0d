#!/usr/bin/env bash
# A separate environment for the DeepSpeed side of benchmarks/moe_vs_deepspeed.py.
# DeepSpeed is never a phalanx dependency: it lives only in benchmarks/.venv-deepspeed, built
# without the system site-packages, with the same torch as the project (2.13.0, CPU wheel from
# the local wheel cache) and DeepSpeed's pure-Python build (no compiled ops: DS_BUILD_OPS=0).
# At its first run DeepSpeed's CPU backend still JIT-compiles one op, its shared-memory
# all-reduce (`deepspeed_shm_comm_op`, with the system C++ compiler and ninja;
# cached under ~/.cache/torch_extensions). The MoE layer's all-to-alls do not use it: they go
# to torch.distributed (gloo), as phalanx's do.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-deepspeed"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q "torch==2.13.0"
DS_BUILD_OPS=0 "$venv/bin/pip" install -q deepspeed
"$venv/bin/python" -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
