#!/usr/bin/env python
"""Held-out loss and perplexity of an original model, a tapered checkpoint (at g = 0) or a folded export.

A Hugging Face-style front end over ``hf-tapernorm eval``; the held-out blocks are the ones
``taper`` builds from the same data arguments::

    python conversion_scripts/eval.py --model_name_or_path runs/demo/folded
"""

from hf_tapernorm.cli.main import command

if __name__ == "__main__":
    command("eval")()
