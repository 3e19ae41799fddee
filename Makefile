# The only two set-up commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test deps bench-smoke clean

$(STAMP): pyproject.toml setup.py kvtier/pagetable/_native.c kvtier/coherence/_fast.c kvtier/_xxh.c \
         kvtier/tiers/_aio.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# System packages the tests start (redis-server, fio, chromium, libxxhash0), where missing.
deps:
	@tools/system-deps

run: deps $(STAMP)
	$(BIN)/kvtier serve

test: deps $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) kvtier-data
