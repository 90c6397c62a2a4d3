#!/usr/bin/env python
"""Fold a saved tapered checkpoint (gate 0) into a norm-free export, with the numerical check.

A Hugging Face-style front end over ``hf-tapernorm fold``::

    python conversion_scripts/fold.py --checkpoint runs/demo/tapered --output_dir exports/demo
"""

from hf_tapernorm.cli.main import command

if __name__ == "__main__":
    command("fold")()
