# The two commands of the README's Quickstart:  make demo  and  make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all
# the rules call `aiayn`, installed into the virtual environment
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test paper-dry-run gpu-wheels clean

install: $(VENV)/.installed

# Exact pins: pyproject.toml pins our direct dependencies, requirements.lock every one.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==25.3
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[test]'
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES)

# A line per test file as it runs (its dots fill in), then the skipped and failed ones (-ra, in
# pyproject.toml) and the 10 slowest tests.
test: install
	$(BIN)/python -m pytest --durations=10

paper-dry-run: install
	$(BIN)/snakemake -n --cores $(CORES) --configfile config/wmt14_en_de.yaml

# The wheels bench/gpu.sh installs on a GPU node whose Python lacks the workflow's packages and which has
# no internet (docs/gpu-check.md): at the lock's versions, into the git-ignored .whl/. GPU_PY=3.11 makes a set for this
# machine's Python, to try the same install here.
GPU_PY ?= 3.12
WHEELS ?= .whl
gpu-wheels: install
	$(BIN)/python -m bench.gpu.wheels --python-version $(GPU_PY) --dest $(WHEELS)

# The demo's outputs and Snakemake's records, for a fresh `make demo`. The MLflow store is kept: every
# experiment's runs share it (results/mlflow.db, its lock, and the artifacts in mlruns/), and a new demo
# adds its runs beside the old ones (`aiayn compare --latest` shows the newest). MLFLOW=1 removes it too.
MLFLOW ?= 0
clean:
	rm -rf results/demo .snakemake
ifeq ($(MLFLOW),1)
	rm -rf results/mlflow.db results/mlflow.db.lock mlruns
else
	@echo "kept the MLflow store of every experiment (results/mlflow.db, mlruns/); make clean MLFLOW=1 removes it too"
endif
