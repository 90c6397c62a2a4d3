"""Two CPU processes (torchrun, gloo, DDP through the Trainer) versus one process on the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_taper import K_END, K_START, STEPS, run

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_compute_the_same_c_and_gates_as_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(ROOT / "tests" / "distributed_taper.py"),
        str(tmp_path),
        "2",
    ]
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    single = run(tmp_path / "single", per_device_batch=4)  # one process, the same global batch of 4
    assert single["world_size"] == 1

    for result in ranks:
        assert [step for step, _ in result["gates"]] == list(range(1, STEPS + 1))
        assert result["gates"] == ranks[0]["gates"] == single["gates"]
        assert result["gates"][K_START - 1][1] == 1.0 and result["gates"][K_END - 1][1] == 0.0
        assert result["c"] == ranks[0]["c"]  # all-reduced statistics: bit-identical c on every rank
        assert result["target"] == ranks[0]["target"]
        assert set(result["ema_steps"].values()) == {K_START}
        assert result["c"] == pytest.approx(single["c"], rel=1e-5)
        assert result["target"] == pytest.approx(single["target"], rel=1e-5)
        assert result["checksum"] == pytest.approx(single["checksum"], rel=1e-5)
