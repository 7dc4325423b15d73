# Two commands: `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m mrtr_keys.run

lint: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_architecture.py
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# the suite mostly waits on subprocess servers and gates: four workers keep both cores busy (worksteal
# rebalances when a worker runs dry; tests/conftest.py starts the longest tests first)
WORKERS ?= 4
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist worksteal

# the fast loop: every test but the end-to-end ones (marker e2e: subprocess servers, OpenBao, moto, the CLI)
fast: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e" -q -p no:cacheprovider -n 2

# make bench BENCH_ARGS='--docs' also refreshes docs/performance.md; BENCH_ARGS='sidecar' runs one part
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mrtr
