#!/usr/bin/env bash
# The prepared GPU check (issues #16, #26): parity of every kernel through the real dispatch point, quantize
# --device cuda of SmolLM2 (GPTQ) with its KL, kernel timings, decode tokens/s with prepared kernels. JSON to
# $OUT/gpu_check.json when OUT is set, rewritten after each phase (a run cut by the limit keeps what it has).
# Under 8 minutes (hard limit 480 s). Arguments go to benchmarks/gpu_check.py: --cpu-checkpoint DIR (KL against a
# CPU-made checkpoint), --skip-quantize / --skip-timing / --skip-decode. The script's CPU smoke test (no GPU):
# python benchmarks/gpu_check.py --dry-run (tests/benchmarks/test_gpu_check_dry_run.py).
# Needs a CUDA build of torch and quantkit-llm[cuda] in $PY's environment (the machine running it may be offline).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
exec timeout 480 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" QUANTKIT_NO_PROGRESS=1 "$PY" benchmarks/gpu_check.py "$@"
