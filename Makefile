# The two commands of the README: `make lab` (open the tutorials) and `make test` (every test).
# TORCH is the torch requirement; the default takes the CPU wheel that CI and Binder use.
# With a GPU:  make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ampnb-installed

.PHONY: lab test unit notebooks notebooks-build browser lint bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[lab,test]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/00_quickstart.ipynb $(LAB_ARGS)

test: $(STAMP) lint unit notebooks browser

lint: $(STAMP)
	$(PY) -m ruff check ampnb tests benchmarks notebooks

unit: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/browser

notebooks: $(STAMP)
	$(PY) -m pytest -q --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider notebooks/*.ipynb

# Rebuild the tutorials from their scripts (notebooks/NN_name.py): execute, keep checked outputs.
# All of them, or some:  make notebooks-build NB="03 04"
notebooks-build: $(STAMP)
	$(PY) notebooks/build.py $(NB)

browser: $(STAMP)
	$(PY) -m pytest -q tests/browser

bench: $(STAMP)
	$(PY) -m benchmarks

# Every CUDA-only test and the GPU benchmarks, report in artifacts/gpu-check.md (exits 0 without CUDA).
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) artifacts .pytest_cache .ruff_cache
