# loraloom: `make demo` runs the demo on the embedded default; `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PG_URL ?= postgresql+psycopg://root@127.0.0.1:5432/postgres

.PHONY: install demo test test-postgres test-sqlite lint typecheck postgres serve clean browser

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the machine's pip finds a local CPU build of exactly this version;
	# anything else would pull gigabytes of CUDA packages.
	$(PIP) install -q torch==2.13.0
	# then the package, editable, with every extra (worker: transformers, peft; plot: matplotlib).
	$(PIP) install -q -e '.[dev,all]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/loraloom demo

# Postgres must answer on 127.0.0.1:5432; start the local cluster if it does not.
postgres:
	@pg_isready -q -h 127.0.0.1 -p 5432 || { \
	  echo "starting PostgreSQL"; \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start; \
	  for i in $$(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done; }
	@pg_isready -h 127.0.0.1 -p 5432

# The design held by tools: lint rules, formatting, types (strict on contracts/ and app/), and the
# import arrows between the parts (tests/test_layering.py).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/test_layering.py

typecheck: install
	$(VENV)/bin/mypy

# Tests run in TEST_WORKERS processes (pytest-xdist), a test file each at a time: much of a test's time
# is waiting on the processes it starts (service, torchrun ranks, browser), so two workers on two
# cores took 14 min where one took 24. Each worker migrates its own database (tests/conftest.py).
# TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-postgres: install postgres
	LORALOOM_TEST_DB=postgres $(VENV)/bin/pytest -q $(XDIST)

# The control plane again on the embedded default (SQLite); Postgres-only tests skip themselves.
test-sqlite: install
	LORALOOM_TEST_DB=sqlite $(VENV)/bin/pytest -q $(XDIST) tests/app

# The dashboard's browser test (tests/e2e/test_dashboard_browser.py) drives Debian's chromium through
# chromium-driver; apt runs only when they are missing (the test skips, saying why, if this fails).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then echo "chromium: present"; else \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver \
	  || echo "could not install chromium (not root?): the browser test will skip"; fi

test: browser lint test-postgres test-sqlite

serve: install
	$(VENV)/bin/loraloom serve

clean:
	rm -rf .loraloom .pytest_cache
