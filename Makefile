# The two commands of the README: `make lab` (open the tutorials) and `make test` (every test).
# TORCH is the torch requirement; the default takes the CPU wheel that CI and Binder use.
# With a GPU:  make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ampnb-installed

.PHONY: lab test unit unit-avx2 notebooks notebooks-build browser lint bench gpu-wheels gpu-check \
        binder-url binder-check docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[lab,test,docs]"
	touch $(STAMP)

# Options for JupyterLab go in LAB_ARGS, e.g. in a container:
#   make lab LAB_ARGS="--no-browser --ip 0.0.0.0 --port 8899 --IdentityProvider.token=SECRET"
# As root (many containers) JupyterLab refuses to start without --allow-root: it is added, and said.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)
ROOT_NOTE := make lab: running as root (uid 0), so JupyterLab gets --allow-root

lab: $(STAMP)
	@$(if $(ROOT_ARGS),echo "$(ROOT_NOTE)")
	$(VENV)/bin/jupyter lab notebooks/00_quickstart.ipynb $(ROOT_ARGS) $(LAB_ARGS)

test: $(STAMP) lint unit unit-avx2 notebooks browser

lint: $(STAMP)
	$(PY) -m ruff check ampnb tests benchmarks notebooks binder docs

unit: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/browser

# The tests whose outcome depends on the CPU's kernels (fp16 kernels, distributed parity, the
# CPU's features, compare, the device choice), again as a CPU with AVX2 only runs them:
# ATEN_CPU_CAPABILITY caps the kernels torch dispatches to. The suite holds on any x86 CPU.
AVX2_TESTS := tests/test_fp16_kernels.py tests/test_kernels_override.py \
              tests/test_distributed_parity.py tests/test_device_cpu.py tests/test_compare.py \
              tests/test_device_placement.py tests/test_magics_kernels_keep.py \
              tests/test_doctor_cpu_classes.py tests/test_doctor_budget.py
# ONEDNN_MAX_CPU_ISA caps oneDNN's kernels (bf16 matmuls, RNNs) as ATEN_CPU_CAPABILITY caps torch's.
unit-avx2: export ONEDNN_MAX_CPU_ISA = AVX2
unit-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 $(PY) -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
	assert c in ('AVX2', 'DEFAULT'), c; print('unit-avx2: torch runs its', c, 'kernels')"
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -p no:cacheprovider $(AVX2_TESTS)

notebooks: $(STAMP)
	$(PY) -m pytest -q --nbval-lax --nbval-sanitize-with notebooks/src/sanitize.cfg -p no:cacheprovider notebooks/*.ipynb

# Rebuild the tutorials (notebooks/NN_name.ipynb) from their scripts (notebooks/src/NN_name.py):
# execute, keep checked outputs. All of them, or some:  make notebooks-build NB="03 04"
notebooks-build: $(STAMP)
	$(PY) notebooks/src/build.py $(NB)

browser: $(STAMP)
	$(PY) -m pytest -q tests/browser

bench: $(STAMP)
	$(PY) -m benchmarks

# The GPU machine (one H100/H200, Python 3.12, torch, no IPython/ipywidgets/nbval, no internet):
# `make gpu-wheels` here downloads the wheels it lacks into artifacts/gpu-wheels; `make gpu-check`
# there (its own python3, no venv) installs them, runs every CUDA-touching test in parallel and
# the GPU benchmarks (bench_gpu section of benchmarks/RESULTS.md) within 5 minutes, and reports
# in artifacts/gpu-check.md. Without CUDA it says so and exits 0.
gpu-wheels: $(STAMP)
	$(PY) -m benchmarks.gpu_check wheels

gpu-check:
	$(PYTHON) -m benchmarks.gpu_check

# The mybinder.org launch link of this checkout's GitHub remote (origin), or how to get one.
binder-url:
	@$(PYTHON) binder/url.py

# Binder's environment for real: a fresh venv from binder/requirements.txt alone runs every
# notebook under nbval within Binder's memory (several minutes; .ci/run runs it).
binder-check: $(STAMP)
	AMPNB_BINDER_CHECK=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/test_binder.py -k fresh_venv

# The documentation site: every tutorial executed (figures, tables, panels' widget state) and the
# reference pages (docs/*.md), warnings as errors; then a check that each page shows what its
# notebook draws. Open build/docs/docs/index.html in a browser.
docs: $(STAMP)
	rm -rf build/docs
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html -c docs . build/docs
	$(PY) docs/check_site.py

clean:
	rm -rf $(VENV) artifacts build .pytest_cache .ruff_cache
