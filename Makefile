# `make demo` and `make test` need nothing installed beforehand: both build .venv/ first.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: setup demo test

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test]"
	# torchrec's metadata requires the CUDA fbgemm-gpu; --no-deps keeps fbgemm-gpu-cpu.
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PY) -c "import torch, torchrec, fbgemm_gpu, lightning, onnxruntime; print('gr env ready: torch', torch.__version__)"
	touch $(STAMP)

STAMP_NOW := $(shell date +%Y%m%d-%H%M%S)
RUN := runs/quickstart-$(STAMP_NOW)
EXPORT := exports/quickstart-$(STAMP_NOW)

# Train on the built-in synthetic data, export the serving slices, validate them, then start the
# HTTP server, send one rank, one recommend and one generate, print the answers and stop it.
demo: $(STAMP)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) train.py --config configs/quickstart.yaml --out $(RUN)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -m gr.export $(RUN) $(EXPORT)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -m gr.export check $(EXPORT)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) examples/http_demo.py $(EXPORT)

test: $(STAMP)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 TORCHINDUCTOR_COMPILE_THREADS=1 $(PY) -m pytest tests
