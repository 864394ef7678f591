# dynarl — the two commands a new user needs:
#   make run    install, then run the control plane with its embedded PostgreSQL and Redis
#   make test   install, then lint and run the whole test suite against real PostgreSQL and Redis
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: run test lint pytest bench install clean-data browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	touch $@

install: $(INSTALLED)

run: $(INSTALLED)
	$(BIN)/python -m controlplane.stack

# The test services default to this machine's PostgreSQL and Redis; override by env.
test: export DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/dynarl
test: export REDIS_URL ?= redis://127.0.0.1:6379/9
test: export SECRET_KEY ?= test-only-secret-key
test: $(INSTALLED) browser lint pytest

# The dashboard's browser tests drive Debian's Chromium through Playwright.
CHROMIUM ?= /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { command -v apt-get >/dev/null && \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y --no-install-recommends chromium >/dev/null; }
	@test -x $(CHROMIUM) || { echo "Chromium not found at $(CHROMIUM); install Debian's chromium package"; exit 1; }

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	SECRET_KEY=$${SECRET_KEY:-lint-only-secret-key} $(BIN)/mypy
	$(BIN)/lint-imports

pytest: $(INSTALLED)
	$(BIN)/pytest

# Every policy on the same traces, then on traces of other length distributions; prints the
# tables recorded in BENCHMARKS.md (about 10 + 15 minutes).
bench: $(INSTALLED)
	$(BIN)/python -m bench.policies
	$(BIN)/python -m bench.robustness

clean-data:
	rm -rf .dynarl
