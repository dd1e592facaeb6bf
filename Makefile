# `make demo` and `make test` need nothing installed beforehand: both build .venv/ first.
PY := .venv/bin/python
GR := .venv/bin/gr
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: setup demo test

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# A distribution named "gr" in .venv/ (ours is gr-hstu) could provide another `gr` package: remove it.
	$(PIP) uninstall -q -y gr 2>/dev/null || true
	$(PIP) install -q -e ".[cpu,test]"
	# torchrec's metadata requires the CUDA fbgemm-gpu; --no-deps keeps fbgemm-gpu-cpu.
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PY) -c "import torch, torchrec, fbgemm_gpu, lightning, onnxruntime; print('gr env ready: torch', torch.__version__)"
	# gr's fused CPU kernels, compiled now rather than at the first training step or test (a failed build
	# is logged and the PyTorch kernels run; cached by content in ~/.cache/gr/extensions). Importing
	# gr.hstu.kernels adds HSTU's kernels to the library gr.ops.native builds.
	$(PY) -c "import gr.hstu.kernels; from gr.ops.native import native_ops; native_ops('gr_cpu_fused')"
	touch $(STAMP)

# TORCH_DEVICE_BACKEND_AUTOLOAD=0 unless this is an Ascend host (torch_npu then loads with torch), decided by
# gr.utils.devices as train.py and tests/conftest.py decide it; a value already in the environment is kept.
AUTOLOAD = $(shell $(PY) -c "from gr.utils.devices import autoload_env; print(*(f'{k}={v}' for k, v in autoload_env().items()))")

STAMP_NOW := $(shell date +%Y%m%d-%H%M%S)
RUN := runs/quickstart-$(STAMP_NOW)
EXPORT := exports/quickstart-$(STAMP_NOW)

# Extra `gr train` options, e.g. DEMO_TRAIN_ARGS="--trainer.max_epochs 2" (tests/test_console.py runs this
# recipe, as `make -n` prints it, at a reduced size).
DEMO_TRAIN_ARGS ?=

# Train on the built-in synthetic data, export the serving slices, validate them, then start the
# HTTP server, send one rank, one recommend and one generate, print the answers and stop it.
demo: $(STAMP)
	$(AUTOLOAD) $(GR) train --config configs/quickstart.yaml --out $(RUN) $(DEMO_TRAIN_ARGS)
	$(AUTOLOAD) $(GR) export $(RUN) $(EXPORT)
	$(AUTOLOAD) $(GR) check $(EXPORT)
	$(AUTOLOAD) $(PY) examples/http_demo.py $(EXPORT)

# GR_TEST_DEVICE=cuda|npu make test: the device suites on that device (tests/conftest.py decides the autoload).
# The suite runs in TEST_WORKERS processes (pytest-xdist), a test module per worker at a time, in the order
# tests/conftest.py gives the modules (the end-to-end ones first), not xdist's (--no-loadscope-reorder).
# It ends with its 15 slowest tests (--durations=15).
TEST_WORKERS ?= 2
# The tests that read MovieLens-100K take it from GR_ML100K_DIR (a path relative to the repository root),
# else from data/ml-100k (`gr data download ml-100k data/ml-100k`), and are skipped when it is absent.
# Left unset, make test sets it to the first that exists of data/ml-100k and ../shared/data/ml-100k (a
# shared/ data directory beside the checkout, where CI's .ci/run points it).
test: export GR_ML100K_DIR ?= $(firstword $(wildcard data/ml-100k ../shared/data/ml-100k))
# Style first (ruff lint + format check, configured in pyproject.toml), then the layers of docs/design.md §3
# (import-linter's contracts in pyproject.toml), then mypy over gr/ ([tool.mypy]; its cache, .mypy_cache/,
# makes a rerun take seconds), then the suite.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	PYTHONPATH=. .venv/bin/lint-imports
	$(PY) -m mypy
	TORCHINDUCTOR_COMPILE_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests
