#!/usr/bin/env bash
# The prepared GPU check of csrc/ (issue #16): parity of every kernel with the torch reference, timings and
# decode tokens/s; JSON to $OUT/gpu_check.json when OUT is set. Under 8 minutes on an H200 (hard limit 480 s).
# Needs a CUDA build of torch and quantkit-llm[cuda] in $PY's environment (the machine running it may be offline).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
exec timeout 480 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" QUANTKIT_NO_PROGRESS=1 "$PY" benchmarks/gpu_check.py "$@"
