"""`hf-tapernorm taper` unchanged under torchrun with 2 CPU processes (gloo) on a tiny model."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm.layers.taper_norm import tapered_norms
from hf_tapernorm.training.checkpoints import load_tapered
from tests.helpers import torchrun_taper


def test_taper_under_torchrun_with_two_cpu_processes(tmp_path):
    _, out = torchrun_taper(tmp_path, ["-m", "hf_tapernorm.cli", "taper"])

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
