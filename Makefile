# The two commands of the README's Quickstart:  make demo  and  make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all
# the rules call `aiayn`, installed into the virtual environment
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test paper-dry-run clean

install: $(VENV)/.installed

# Exact pins: pyproject.toml pins our direct dependencies, requirements.lock every one.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==25.3
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[test]'
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES)

test: install
	$(BIN)/python -m pytest -q

paper-dry-run: install
	$(BIN)/snakemake -n --cores $(CORES) --configfile config/wmt14_en_de.yaml

clean:
	rm -rf results/demo .snakemake
