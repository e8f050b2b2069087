#!/usr/bin/env bash
# Builds llama.cpp (through llama-cpp-python, from its source package) in its own venv for the side-by-side
# runtime and speculative-decoding benchmarks. Minutes on 2 cores; idempotent.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-llama"
PY="$VENV/bin/python"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

if [ -x "$PY" ] && "$PY" -c "import llama_cpp, torch, sentencepiece, psutil" 2>/dev/null \
        && [ -f "$VENV/.built-without-amx" ]; then
    echo "llama-cpp-python venv already usable: $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Built for this CPU's own vector instruction set, as a user building llama.cpp locally gets it, but without
# AMX: a GGML_NATIVE build (which enables AMX here) segfaults in its first quantised (Q4_0/Q4_1) decode on
# this project's KVM machines, while its bf16 path runs.
flags=$(grep -m1 -o -w 'avx512f\|avx512_vnni\|avx512_bf16\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')
args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
for f in $flags; do
    case $f in
        avx512f) args="$args -DGGML_AVX512=ON" ;;
        avx512_vnni) args="$args -DGGML_AVX512_VNNI=ON" ;;
        avx512_bf16) args="$args -DGGML_AVX512_BF16=ON" ;;
        avx_vnni) args="$args -DGGML_AVX_VNNI=ON" ;;
    esac
done
"$PY" -m pip uninstall --quiet -y llama-cpp-python 2>/dev/null || true
CMAKE_ARGS="$args" "$PY" -m pip install --quiet --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
# The HF -> GGUF converter ships inside the source package's vendored llama.cpp; its Python needs these
# (the local CPU torch first, re-pinned so the resolver never swaps in a CUDA build).
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet "torch==2.13.0" numpy sentencepiece gguf safetensors transformers psutil
if [ ! -d "$VENV/src" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$VENV/src" "llama-cpp-python==$VERSION"
    tar -xzf "$VENV"/src/llama_cpp_python-*.tar.gz -C "$VENV/src"
fi
touch "$VENV/.built-without-amx"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
