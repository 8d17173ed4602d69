# Two commands do all set-up and work on a fresh machine: `make demo` and `make test`.
# The venv pins torch==2.13.0 (the CPU wheel on these machines) unless the Python that creates it
# already has a torch (a cluster module, a ROCm build): then the venv inherits it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-slow test-slurm bench clean docs repro

venv: $(STAMP)

# pyproject.toml reads its dependencies from requirements/*.txt, so a change there reinstalls too.
# A python that is itself a venv (e.g. an image's /opt/venv holding its ROCm torch) does not pass its
# packages on through --system-site-packages, so the new venv gets a .pth naming its site-packages.
# Extras: `gpu` brings PyPI's triton (CUDA, and CPU where tests run Triton under TRITON_INTERPRET=1);
# on a ROCm torch `rocm` instead, since the ROCm torch ships its own triton that PyPI's would break.
$(STAMP): pyproject.toml Makefile $(wildcard requirements/*.txt)
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "[setup] using the torch already present in $(PYTHON)"; \
	  if [ ! -x $(PY) ]; then \
	    $(PYTHON) -m venv --system-site-packages $(VENV) && \
	    $(PYTHON) -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
	      > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_neox_outer_venv.pth"; \
	  fi; \
	else \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q "$(TORCH_PIN)"; \
	fi
	@extras=$$($(PY) -c "import torch; print('test,rocm' if torch.version.hip else 'test,gpu')"); \
	  echo "[setup] pip install -e .[$$extras]"; \
	  $(PY) -m pip install -q -e ".[$$extras]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) deepy.py train.py configs/tiny-cpu.yml configs/sim-2x2x2.yml configs/zero_topo.yml

# The loss-curve recipe (docs/loss_curves.md): data, five training runs, their figure and table.
# `make repro` is the full recipe (52 minutes measured on 2 cores) and publishes docs/figures/loss_curves.*;
# `make repro REPRO_STEPS=20` is a quick end-to-end check in runs/repro/20steps/ that publishes nothing.
repro: $(STAMP)
	$(PY) tools/repro_loss_curves.py $(if $(REPRO_STEPS),--steps $(REPRO_STEPS),--publish docs/figures)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not slurm"

# The job scripts under a real Slurm on this machine (docs/launch.md, "A real Slurm here"): installs
# Debian's slurm-wlm and munge when missing (root), starts slurmctld + two slurmd, submits with sbatch.
test-slurm: $(STAMP)
	$(PY) -m pytest -q -m slurm tests/test_slurm_real.py

docs: $(STAMP)
	$(PY) -m megatron.config.docs > docs/config.md

clean:
	rm -rf $(VENV) build *.egg-info
