"""Smoke test of the GPU-ready all-norm run (conversion_scripts/experiments/mlp_norms/gpu_run.py).

A tiny random Llama on standard-library bytes, 4 steps on CPU, no download: the tapered arm must
reach g = 0 on every internal norm, fold exactly, and the report must be written.
"""

import json

import torch


def test_gpu_run_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("MLPNORMS_ROOT", str(tmp_path / "root"))
    torch.set_num_threads(1)
    from conversion_scripts.experiments.mlp_norms import gpu_run

    out = tmp_path / "out"
    report = gpu_run.main(["--out", str(out), "--tiny", "--max-steps", "4", "--device", "cpu", "--no-bf16"])
    saved = json.loads((out / "report.json").read_text())
    assert (out / "report.md").exists()
    assert saved["tapered"]["status"] == "completed"
    gates = saved["tapered"]["final_gates"]
    assert gates["gate"] == 0.0 and gates["norms_at_0"] == 4  # 2 layers x (attention + MLP norm)
    assert saved["tapered"]["fold"]["ok"], saved["tapered"]["fold"]
    assert saved["baseline"]["final_eval_ce"] is not None
    assert report["gap_pct"] is not None
