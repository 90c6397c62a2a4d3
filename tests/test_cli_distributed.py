"""`hf-tapernorm taper` unchanged under torchrun with 2 CPU processes (gloo) on a tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm.layers.taper_norm import tapered_norms
from hf_tapernorm.training.checkpoints import load_tapered
from tests.conftest import corpus_documents, save_tiny_model

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_taper_under_torchrun_with_two_cpu_processes(tmp_path):
    save_tiny_model(tmp_path / "llama")
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), "-m", "hf_tapernorm.cli", "taper",
        "--model_name_or_path", str(tmp_path / "llama"), "--dataset_name", str(tmp_path / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "8",
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "5", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("hf-tapernorm taper: summary") == 1  # only the main process reports

    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished"
    assert report["training"]["world_size"] == 2 and report["training"]["global_batch_blocks"] == 4
    assert report["training"]["steps"] == 8 and report["training"]["tokens"] == 8 * 4 * 32
    assert [r["gate"] for r in report["history"]][-4:] == [0.0] * 4
    tapered = load_tapered(out / "tapered")
    assert all(layer.is_calibrated and float(layer.gate) == 0.0 for _, layer in tapered_norms(tapered))
    folded = AutoModelForCausalLM.from_pretrained(out / "folded")
    ids = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(0))
    sink = report["taper"]["sink_token_ids"]  # the default sink (internal scope): the folded model holds it
    assert folded.config.sink_token_ids == sink == tapered.tapernorm_config.sink_token_ids
    with torch.no_grad():
        expected = tapered(input_ids=torch.cat([torch.tensor(sink).expand(2, -1), ids], 1)).logits[:, len(sink) :]
        assert torch.allclose(folded.eval()(input_ids=ids).logits, expected, atol=1e-4 * float(expected.abs().max()))
