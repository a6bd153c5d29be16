# Everything a fresh Debian machine needs, then the job. `make train` and `make test` each set up first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
# torch's build, installed first so that nothing below picks another. PyPI's torch==2.13.0 for Linux is a CUDA
# build (its nvidia-* wheels make the venv about 5.8 GB; it runs on a machine without a GPU too). PyTorch's own
# CPU index has a CPU-only one, for a smaller venv on such a machine:
#   make setup TORCH=torch==2.13.0+cpu TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_CHOICE := $(VENV)/.torch

.PHONY: setup debs train test test-all lint clean gpu-kit FORCE

# libaio-dev: what DeepSpeed's async_io op (NVMe offload) links against. chromium: the browser the builder
# page's tests drive through Playwright (Playwright's own browser download is not used). slurmctld, slurmd,
# slurm-client: the two-node SLURM cluster scripts/slurm_local.sh runs on this machine (tests/test_slurm.py);
# no slurmdbd: nothing here needs SLURM's accounting.
DEBS    := libaio-dev chromium slurmctld slurmd slurm-client

setup: debs $(STAMP)

# Checked on every run (dpkg is quick): a venv kept from before still gets a package added since.
debs:
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# Rewritten only when the choice of torch changes, so that a venv set up with another build installs this one.
$(TORCH_CHOICE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH) $(TORCH_INDEX)' > $@

$(STAMP): pyproject.toml $(TORCH_CHOICE)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q '$(TORCH)' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[wandb,tensorboard,gpu,slurm,dev]'
	@# The original Stable Diffusion code (its `ldm` package), whose UNetModel names the original checkpoint
	@# layout in the single-file tests. --no-deps: its pins (transformers 4.33, lightning 1.4) would downgrade
	@# the stack, and its U-Net needs only torch and einops.
	$(PIP) install -q --no-deps stable-diffusion-sdkit==2.1.5
	@# DeepSpeed's CPU ops (CPU Adam, the shared-memory collectives), compiled once now rather than by the first job.
	$(PY) -m zerotune.host.ops || echo "DeepSpeed's CPU ops were not built now: the first job that needs them builds them"
	@$(PY) -c "import torch; b = f'CUDA {torch.version.cuda} build' if torch.version.cuda else 'CPU-only build'; \
		print(f'torch {torch.__version__} ({b}); the venv: $$(du -sh $(VENV) | cut -f1)')"
	touch $(STAMP)

train: setup
	$(PY) train.py

# The suite without the long end-to-end runs (marked slow), one pytest-xdist worker per core, each with its share of
# the cores' torch threads; tests sharing a trained run, a cluster or a browser run on one worker
# (tests/helpers/xdist_groups.py). About 14 minutes on 2 cores, 17 from a fresh clone with PyPI's CUDA torch.
test: setup
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadgroup

# Everything, slow runs included (every stage x offload, NVMe, fidelity, sweeps, resume, multi-process), in one
# process: the slow set's SLURM pre-emption and multi-process runs are timed against one machine's cores.
test-all: setup
	$(PY) -m pytest -q

# The GPU kit (docs/gpu-kit.md): every wheel the GPU machine's image lacks, for its CPython 3.12, into .whl/
# (git-ignored; under 64 MiB, what the device tool carries). Then on the card: bash benchmarks/gpu/run.sh PART.
gpu-kit: setup
	bash benchmarks/gpu/build_kit.sh .whl 3.12

# ruff, the type checker (over all of src/: pyproject.toml [tool.mypy] files) and the import contracts.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf outputs multirun/*/ .pytest_cache
