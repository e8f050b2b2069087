#!/usr/bin/env bash
# Builds the reference-tool venv (llm-compressor) used by the side-by-side benchmarks.
# Kept separate from quantkit's own venv so the two tools never share dependency pins.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-llmc"
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"  # the local CPU wheel; installed first so llmcompressor's deps resolve onto it

# Idempotent: a venv whose imports already work is left untouched.
if [ -x "$PY" ] && "$PY" -c "import llmcompressor, compressed_tensors, psutil, datasets, torch" 2>/dev/null; then
    echo "llm-compressor venv already usable: $("$PY" -c 'import llmcompressor; print(llmcompressor.__version__)')"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
# Re-pinning torch in the same command stops the resolver from swapping in a CUDA build.
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" llmcompressor psutil

"$PY" -c "import torch, llmcompressor; print('torch', torch.__version__, '| llmcompressor', llmcompressor.__version__)"
