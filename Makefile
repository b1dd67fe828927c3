# The two set-up commands of the README. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Without CUDA, pin the CPU build of torch (a newer range would pull gigabytes of CUDA wheels).
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_CUDA),torch,torch==2.13.0)
# Triton, so that the tests run the GPU kernels on the CPU under its interpreter and compile
# them for sm_90 with its ptxas (registers, instructions). CUDA torch brings its own; the CPU
# build does not, so pin the version the GPU machines run.
TRITON_PIN := $(if $(HAS_CUDA),,triton==3.6.0)

# openai-harmony fetches its vocabulary on first use; offline machines keep it beside the checkout.
VOCAB_DIR := $(abspath ../shared/vocab)
ifneq ($(wildcard $(VOCAB_DIR)/o200k_base.tiktoken),)
export TIKTOKEN_ENCODINGS_BASE ?= $(VOCAB_DIR)
endif

.PHONY: install serve test lint generate clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)" $(TRITON_PIN)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The Responses API on the built-in demo model, on http://127.0.0.1:8000.
serve: $(STAMP)
	$(BIN)/gptoss-serve serve --model demo $(SERVE_ARGS)

# Without CUDA a second pytest runs the Triton kernels' tests under Triton's interpreter, on CPU
# tensors (the first skips them: TRITON_INTERPRET=1 must be set before triton is imported).
# With CUDA the first runs the same kernels on the GPU.
INTERPRETED_TESTS := $(if $(HAS_CUDA),,HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(BIN)/pytest -q -m "not gpu" tests/kernels)

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q
	$(INTERPRETED_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

# A generation on the built-in demo model (random weights: the text is gibberish by design).
generate: $(STAMP)
	$(BIN)/gptoss-serve generate --model demo --prompt "Say hello." --max-tokens 48 --show-analysis

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
