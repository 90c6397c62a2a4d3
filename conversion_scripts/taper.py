#!/usr/bin/env python
"""Taper the norms of a causal LM away during continued pretraining, then fold and export it.

A Hugging Face-style front end over ``hf-tapernorm taper``; every ``TrainingArguments`` option
passes through, and a single ``.json``/``.yaml`` argument is read as the whole configuration::

    python conversion_scripts/taper.py --output_dir runs/demo --overwrite          # embedded default
    python conversion_scripts/taper.py --model_name_or_path HuggingFaceTB/SmolLM2-360M \
        --dataset_name my_corpus.jsonl --max_steps 300 --baseline --output_dir runs/360m
"""

from hf_tapernorm.cli.main import command

if __name__ == "__main__":
    command("taper")()
