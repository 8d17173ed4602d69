# Two commands do all set-up and work on a fresh machine: `make demo` and `make test`.
# The venv pins torch==2.13.0 (the CPU wheel on these machines) unless the Python that creates it
# already has a torch (a cluster module, a ROCm build): then the venv inherits it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-slow bench clean docs

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "[setup] using the torch already present in $(PYTHON)"; \
	  [ -x $(PY) ] || $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q "$(TORCH_PIN)"; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) deepy.py train.py configs/tiny-cpu.yml configs/sim-2x2x2.yml configs/zero_topo.yml

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

docs: $(STAMP)
	$(PY) -m megatron.config.docs > docs/config.md

clean:
	rm -rf $(VENV) build *.egg-info
