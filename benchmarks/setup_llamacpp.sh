#!/usr/bin/env bash
# Builds llama.cpp (through llama-cpp-python, from its source package) in its own venv for the side-by-side
# runtime and speculative-decoding benchmarks. Minutes on 2 cores; idempotent.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-llama"
PY="$VENV/bin/python"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

if [ -x "$PY" ] && "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python venv already usable: $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# GGML_NATIVE builds for this CPU's own instruction set (what a user building llama.cpp locally gets).
CMAKE_ARGS="-DGGML_NATIVE=ON" "$PY" -m pip install --quiet --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
# The HF -> GGUF converter ships inside the source package's vendored llama.cpp; its Python needs these.
"$PY" -m pip install --quiet numpy sentencepiece gguf safetensors
"$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$VENV/src" "llama-cpp-python==$VERSION"
tar -xzf "$VENV"/src/llama_cpp_python-*.tar.gz -C "$VENV/src"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
