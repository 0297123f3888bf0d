#!/usr/bin/env bash
# One bounded check of a CUDA device (docs/device_check.md):
#   benchmarks/device_check.sh [--out DIR] [--budget-s 540] [--only PART,...] [--cluster NAME]
#   benchmarks/device_check.sh --dry-run     # every part at tiny sizes on the CPU
# Without a CUDA device (and without --dry-run) it says so in one line and exits 2.
# The Python is $PYTHON, else this checkout's .venv, else python3 (a GPU node's own torch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" "$root/benchmarks/device_check.py" "$@"
