#!/usr/bin/env python
"""Benchmark original / explicit (g = 0) / folded / limit variants of a model, interleaved.

Same arguments as `hf-tapernorm bench` (see `--help`); a thin front end over hf_tapernorm.bench.

    python conversion_scripts/benchmark.py --modes last decode --dtypes fp32 --threads 2
"""

from hf_tapernorm.bench.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
