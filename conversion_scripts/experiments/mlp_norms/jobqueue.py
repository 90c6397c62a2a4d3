"""A tiny job queue for the CPU grid: runs the lines of a queue file, at most N at once.

N is re-read from /tmp/mlpnorms/cpu_budget before every launch (the lead raises it when cores free
up). Lines are shell commands; a line is done once it has been launched (recorded in <queue>.done);
lines can be appended while the queue runs; a line ``STOP`` ends it once all running jobs finished.

    python -m conversion_scripts.experiments.mlp_norms.jobqueue /tmp/mlpnorms/queue.txt
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))


def budget() -> int:
    try:
        return max(1, int((ROOT / "cpu_budget").read_text().strip()))
    except (OSError, ValueError):
        return 1


def main() -> None:
    queue = Path(sys.argv[1])
    done_path = queue.with_suffix(queue.suffix + ".done")
    done = set(done_path.read_text().splitlines()) if done_path.exists() else set()
    running: list[tuple[subprocess.Popen, str]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    while True:
        running = [(p, line) for p, line in running if p.poll() is None]
        lines = [line.strip() for line in queue.read_text().splitlines() if line.strip() and not line.startswith("#")]
        pending = [line for line in lines if line not in done and line != "STOP"]
        if not pending and "STOP" in lines and not running:
            return
        if pending and len(running) < budget():
            line = pending[0]
            done.add(line)
            with done_path.open("a") as f:
                f.write(line + "\n")
            log = ROOT / "logs" / f"queue_{int(time.time())}.out"
            print(time.strftime("%H:%M:%S"), "start:", line, "->", log, flush=True)
            running.append(
                (subprocess.Popen(line, shell=True, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env), line)
            )
            continue
        time.sleep(15)


if __name__ == "__main__":
    main()
