# Two commands: `make run` and `make test`. Both set up .venv on first use.
# The interpreter .venv is built from: the distribution's /usr/bin/python3 when it is 3.11 or newer and can make a
# venv (Debian's and Ubuntu's CPython are built with PGO and LTO, libpython linked in), else python3 on PATH. A
# default pyenv build has neither. Run alternately on this 2-core host (2026-12-03, fresh clones), `make fast` took
# 23 to 26 s against 29 s (34 to 38 CPU-s against 40 to 42), and `make test` 4 min 38 s against 4 min 48 s: the
# suite also runs node, OpenBao, PostgreSQL, uv, ruff and mypy. `make PYTHON=python3.12 test` chooses another.
SYSTEM_PYTHON := $(shell /usr/bin/python3 -c 'import sys, ensurepip; ensurepip.version(); \
	print(sys.executable if sys.version_info >= (3, 11) else "")' 2>/dev/null)
PYTHON ?= $(or $(SYSTEM_PYTHON),python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test fast lint lock deps-audit sbom bench bench-check clean ts-test

# Some hosts set PYTHONDONTWRITEBYTECODE=1: then every test worker, CLI run and server recompiles the package
# and pytest rewrites every test module again (about 4 s of CPU per worker). Compiled files stay in __pycache__.
unexport PYTHONDONTWRITEBYTECODE

# .venv holds exactly what uv.lock says (every extra and dependency group, each artifact checked against its sha256):
# the locked uv is bootstrapped with pip from requirements/uv.txt (hashed), then `uv sync --frozen` installs the
# rest without resolving anything, and builds the project with the locked setuptools (no build isolation, so the
# build backend is locked too). Where uv cannot be had (an offline mirror without it, a platform without its
# wheel), pip installs the same pins and hashes from requirements/all.txt less uv itself (`tools/lock.py fallback`;
# such a .venv has no uv, so `make lint`'s lock check and `make sbom` say they need it). `make lock` refreshes
# the lock and the files made from it (tools/lock.py); `make lint` fails while pyproject.toml and uv.lock disagree.
UV_SYNC = UV_PROJECT_ENVIRONMENT=$(VENV) $(BIN)/uv sync --quiet --frozen --all-extras --all-groups --python $(BIN)/python
$(STAMP): pyproject.toml uv.lock requirements/all.txt requirements/uv.txt
	$(PYTHON) -m venv $(VENV)
	if $(BIN)/pip install --quiet --require-hashes --no-deps -r requirements/uv.txt > $(VENV)/uv-install.log 2>&1; then \
		$(UV_SYNC) --no-install-project && $(UV_SYNC) --no-build-isolation --compile-bytecode; \
	else \
		echo "uv could not be installed ($(VENV)/uv-install.log): pip installs requirements/all.txt without uv"; \
		$(BIN)/python tools/lock.py fallback > $(VENV)/requirements-pip.txt \
			&& $(BIN)/pip install --quiet --require-hashes -r $(VENV)/requirements-pip.txt \
			&& $(BIN)/pip install --quiet --no-deps --no-build-isolation -e .; \
	fi
	touch $(STAMP)

# make lock LOCK_ARGS=--upgrade moves every pin to the newest release pyproject.toml allows
lock: $(STAMP)
	$(BIN)/python tools/lock.py write $(LOCK_ARGS)

run: $(STAMP)
	$(BIN)/python -m mrtr_keys.run

# the lock agrees with pyproject.toml, the layer rule, the threat model's test ids (each one docs/security.md
# names is collected and not skipped), ruff and mypy. ruff check runs without its cache (half a second more): its
# import sorting depends on which modules exist, and a cache made before a move passed what a fresh clone fails
lint: $(STAMP)
	@$(BIN)/python tools/lock.py check
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_architecture.py
	$(BIN)/python -m tests.docs.security_ids
	$(BIN)/ruff check --no-cache src tests bench tools
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/mypy

# the suite mostly waits on subprocess servers and gates: six workers keep both cores busy (worksteal
# rebalances when a worker runs dry; tests/conftest.py starts the longest tests first). The CLI, sidecars and
# example servers the tests start are forked from one pre-imported interpreter per worker
# (tests/support/zygote.py): the same code in its own process, without paying the imports each time.
# Lint runs beside the tests (mypy is single-threaded: run first, it left a core idle for its whole run); its
# output follows the tests' and either failing fails `make test`. The layer check runs once, in lint.
WORKERS ?= 6
LINT_LOG := $(VENV)/lint.log
test: $(STAMP)
	@$(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist worksteal \
		--ignore tests/test_architecture.py; tests=$$?; \
	wait $$lint; linted=$$?; cat $(LINT_LOG); \
	if [ $$linted -ne 0 ]; then echo "make test: lint failed (above)" >&2; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# the TypeScript client (clients/typescript, docs/typescript.md): npm ci from the lockfile, type check, node tests
# against a real `mrtr-keys serve`; without node on PATH, one line and success (CI has node and runs it).
# `make test` runs the same node tests as one pytest test (tests/typescript/test_node_suite.py), beside the rest.
TS := clients/typescript
ts-test: $(STAMP)
	@if ! command -v node >/dev/null 2>&1; then \
		echo "TypeScript tests not run: node is not on PATH (clients/typescript needs Node 20 or newer)"; \
	elif ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)'; then \
		echo "TypeScript tests need Node 20 or newer; found $$(node --version)" >&2; exit 1; \
	else \
		cd $(TS) && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build:test \
			&& MRTR_KEYS_CLI=$(CURDIR)/$(BIN)/mrtr-keys node --test --test-reporter=spec build/test/*.test.js; \
	fi

# the fast loop: every test but the end-to-end ones (marker e2e: subprocess servers, OpenBao, moto, the CLI).
# The directories that are end to end as a whole are not even imported (tests/conftest.py). Four workers: each
# pays about 2.4 s of CPU to import and collect (the first 5 to 6 s of a run, all four at once), and a fourth
# fills the time the others wait on a deadline or a killed writer (measured 2026-12-03, three runs each,
# interleaved: -n 3 35.5 to 37.3 s, -n 4 35.1 to 36.4 s on the same busy host). worksteal and the fast loop's
# longest tests first (LONG_FIRST in tests/conftest.py): the four workers end within half a second of each other.
fast: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e" -q -p no:cacheprovider -n 4 --dist worksteal

# make bench BENCH_ARGS='--docs' also refreshes docs/performance.md; BENCH_ARGS='sidecar' runs one part
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mrtr

# known vulnerabilities in the locked set (pip-audit over requirements/all.txt against OSV; npm audit --omit=dev over
# clients/typescript's lockfile): a finding fails unless osv-scanner.toml holds a reviewed, unexpired exception; a
# service that cannot be reached is one line and passes (tools/deps_audit.py, docs/supply-chain.md). .ci/run runs it.
deps-audit: $(STAMP)
	$(BIN)/python tools/deps_audit.py $(AUDIT_ARGS)

# CycloneDX JSON of the locked Python set and the TypeScript package: build/sbom/python.cdx.json and
# typescript.cdx.json (tools/sbom.py); the image build copies them in (Dockerfile)
sbom: $(STAMP)
	$(BIN)/python tools/sbom.py

# the audit rows of HEAD against BASE (default: the commit of docs/performance.md's table), built in a worktree
# with its own venv (cached under .venv/bench-base/) and measured interleaved in one session; fails when a row of
# HEAD is more than 20 % worse than the base's (bench/check.py). About 5 minutes.
bench-check: $(STAMP)
	$(BIN)/python -m bench.check $(if $(BASE),--base $(BASE))
