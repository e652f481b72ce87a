# `make demo`: create the virtual environment if needed, install postrl, run the main job (postrl train).
# `make test`: same set-up, then the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.postrl-installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/postrl train

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
