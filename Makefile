# The only two set-up commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench-smoke clean

$(STAMP): pyproject.toml setup.py kvtier/pagetable/_native.c kvtier/coherence/_fast.c kvtier/_xxh.c \
         kvtier/tiers/_aio.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier serve

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) kvtier-data
