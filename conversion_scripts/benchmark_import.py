#!/usr/bin/env python
"""What ``import hf_tapernorm`` costs over transformers, measured in fresh interpreters side by side.

Each repeat runs the cases below in its own subprocess, interleaved (so a busy machine slows all alike),
and prints the median and minimum wall time of the measured statement::

    python conversion_scripts/benchmark_import.py --repeats 7

- ``transformers``: ``import transformers`` alone;
- ``transformers + hf_tapernorm``: the same, then ``import hf_tapernorm``;
- ``AutoConfig`` / ``AutoConfig + hf_tapernorm``: ``from transformers import AutoConfig`` with and without
  hf_tapernorm imported first, which includes registering the folded types (export/registration.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = {
    "transformers": ("", "import transformers"),
    "transformers + hf_tapernorm": ("", "import transformers, hf_tapernorm"),
    "AutoConfig": ("", "from transformers import AutoConfig"),
    "AutoConfig + hf_tapernorm": ("", "import hf_tapernorm\nfrom transformers import AutoConfig"),
}
TIMER = "import time\n{setup}\nstart = time.perf_counter()\n{statement}\nprint(time.perf_counter() - start)\n"


def measure(setup: str, statement: str) -> float:
    code = TIMER.format(setup=setup, statement=statement)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters per case")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, (setup, statement) in CASES.items():
            seconds[name].append(measure(setup, statement))
    width = max(map(len, CASES))
    print(f"{'case':<{width}}  median s  min s")
    for name, values in seconds.items():
        print(f"{name:<{width}}  {statistics.median(values):8.3f}  {min(values):5.3f}")
    for base, with_package in (
        ("transformers", "transformers + hf_tapernorm"),
        ("AutoConfig", "AutoConfig + hf_tapernorm"),
    ):
        extra = statistics.median(seconds[with_package]) - statistics.median(seconds[base])
        print(f"hf_tapernorm over {base}: {extra:+.3f} s (median)")


if __name__ == "__main__":
    main()
