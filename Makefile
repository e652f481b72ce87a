# `make demo`: create the virtual environment if needed, install postrl, run the main job (postrl train).
# `make test`: same set-up plus the test extras, then the whole test suite.
# `make builtin`: rebuild the shipped warm-started model of the main job (postrl/models/shipped/) from scratch;
# `make builtin-calculator`: the calculator recipe's (multi-turn tool use) shipped model; `make builtin-tool-calls`:
# the tool_calls recipe's (ToolRL call prediction); `make builtin-scratchpad`: the scratchpad recipe's (the reasoning
# testbed of issue 32).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
CORE := $(VENV)/.postrl-core
DEV := $(VENV)/.postrl-dev

.PHONY: demo test soak install clean builtin builtin-calculator builtin-tool-calls builtin-scratchpad

install: $(DEV)

# torch is pinned to the CPU wheel (a looser requirement pulls a multi-GB CUDA build).
$(CORE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e .
	@touch $(CORE)

# verl (the plug-in's tests) without its dependency pins (verl 0.9.1 pins transformers < 5.11): only what its
# registries, DataProto, configs and compute_advantage need on a CPU. OpenEnv (the openenv environment's tests)
# without its web UI (gradio, which pins pillow < 13): openenv.core and the MCP client it imports (fastmcp, with
# the mcp version verifiers 0.4 pins).
$(DEV): $(CORE)
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps verl==0.9.1
	$(PIP) ray 'tensordict>=0.8,<0.11,!=0.9.0' hydra-core codetiming torchdata
	$(PIP) --no-deps openenv==0.4.1
	$(PIP) fastmcp 'mcp==2.0.0'
	@touch $(DEV)

demo: $(CORE)
	$(VENV)/bin/postrl train

test: $(DEV)
	$(PY) -m pytest -q -m "not slow"

# `make soak`: the slow tests (the 2,000-step soak of the demo config, docs/reliability.md), outside `make test`.
soak: $(DEV)
	$(PY) -m pytest -q -m slow

builtin: $(CORE)
	$(PY) -m postrl.train.builtin

builtin-calculator: $(CORE)
	$(PY) -m postrl.train.builtin calculator

builtin-tool-calls: $(CORE)
	$(PY) -m postrl.train.builtin tool_calls

builtin-scratchpad: $(CORE)
	$(PY) -m postrl.train.builtin scratchpad

clean:
	rm -rf $(VENV) runs .pytest_cache
