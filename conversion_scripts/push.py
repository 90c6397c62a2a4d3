#!/usr/bin/env python
"""Push a folded export (weights, config, modeling code, tokenizer, model card) to the Hugging Face Hub.

A front end over ``hf-tapernorm push``::

    python conversion_scripts/push.py --export_dir runs/demo/folded --repo_id me/smollm2-135m-normfree
"""

from hf_tapernorm.cli.main import command

if __name__ == "__main__":
    command("push")()
