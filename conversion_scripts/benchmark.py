#!/usr/bin/env python
"""Benchmark the inference variants (original / explicit / folded / limit) and the recipe's training phases.

A front end over ``hf-tapernorm bench``, with the same arguments (``--help``) and the same one-line errors::

    python conversion_scripts/benchmark.py --modes last decode --threads 1
    python conversion_scripts/benchmark.py --norms recipe internal all --modes last decode
    python conversion_scripts/benchmark.py --modes train --calibration_batches 2 --repeats 6
"""

from hf_tapernorm.cli.main import command

if __name__ == "__main__":
    command("bench")()
