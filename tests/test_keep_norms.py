"""keep_norms: norms inside the patched scope that stay real norms (the norms feeding gated MLPs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, export_folded, fold_model, patch_model
from hf_tapernorm.architectures import norms_feeding_gated_mlps
from hf_tapernorm.export.modeling_folded import WeightlessRMSNorm
from hf_tapernorm.layers import tapered_norms
from hf_tapernorm.training.checkpoints import load_tapered, save_tapered
from tests.conftest import (
    DISCOVERED_CASES,
    FAMILY_CASES,
    build,
    tiny_family_config,
    tiny_gpt2_config,
    tiny_llama_config,
)
from tests.helpers import IDS, logits, relative_error, tapered

MLP_NORMS = ["model.layers.0.post_attention_layernorm", "model.layers.1.post_attention_layernorm"]


def test_the_norms_feeding_gated_mlps_are_llamas_post_attention_norms_and_none_of_gpt2():
    assert norms_feeding_gated_mlps(build(tiny_llama_config())) == MLP_NORMS
    assert norms_feeding_gated_mlps(build(tiny_gpt2_config())) == []  # GELU MLP: nothing multiplies two projections


def test_kept_norms_stay_normalized_at_every_gate_and_survive_the_fold(tmp_path):
    model = tapered("llama", keep_norms=["*.post_attention_layernorm"])
    layers = dict(tapered_norms(model, include_kept=True))
    assert [name for name, layer in layers.items() if not layer.tapered] == MLP_NORMS + ["model.norm"]
    assert all(float(layers[name].gate) == 1.0 for name in MLP_NORMS)  # set_gate(model, 0) left them alone
    assert float(layers["model.layers.0.input_layernorm"].gate) == 0.0
    h = torch.randn(2, 5, 32)
    torch.testing.assert_close(layers[MLP_NORMS[0]](h), layers[MLP_NORMS[0]]._normalized(h))

    folded = fold_model(model)
    assert folded.config.kept_norms == MLP_NORMS + ["model.norm"]
    assert folded.config.folded_norms == ["model.layers.0.input_layernorm", "model.layers.1.input_layernorm"]
    assert isinstance(folded.get_submodule("model.layers.0.input_layernorm"), nn.Identity)
    kept = folded.get_submodule(MLP_NORMS[1])
    assert isinstance(kept, WeightlessRMSNorm) and not list(kept.parameters())  # its weight is in gate/up_proj
    assert relative_error(logits(folded, IDS), logits(model, IDS)) <= 1e-5
    reloaded = AutoModelForCausalLM.from_pretrained(export_folded(folded, tmp_path / "out"))
    assert torch.equal(logits(reloaded, IDS), logits(folded, IDS))
    assert (
        "| Norms kept | 3 (e.g. `model.layers.0.post_attention_layernorm`) |"
        in (tmp_path / "out" / "README.md").read_text()
    )


def test_a_tapered_checkpoint_reloads_with_the_same_kept_norms(tmp_path):
    model = tapered("llama", keep_norms=MLP_NORMS)
    save_tapered(model, tmp_path / "ckpt")
    reloaded = load_tapered(tmp_path / "ckpt")
    assert {n: m.tapered for n, m in tapered_norms(reloaded, include_kept=True)} == {
        n: m.tapered for n, m in tapered_norms(model, include_kept=True)
    }
    assert torch.equal(logits(reloaded.eval(), IDS), logits(model, IDS))


def test_a_pattern_that_matches_no_norm_is_refused_with_the_names_to_use():
    with pytest.raises(
        ValueError,
        match=r"keep_norms pattern\(s\) \['\*\.ln_2'\] match no norm of LlamaForCausalLM "
        r"\(llama\); norms are named like 'model.layers.0.input_layernorm'",
    ):
        patch_model(build(tiny_llama_config()), TaperNormConfig.paper(keep_norms=["*.ln_2"]))


def test_keep_norms_only_narrows_the_scope():
    # A kept pattern outside the scope changes nothing: scope final tapers only the final norm either way.
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(scope="final", keep_norms=MLP_NORMS))
    assert [name for name, layer in tapered_norms(model, include_kept=True) if layer.tapered] == ["model.norm"]


GATED_MLP_INPUT = {  # the norm in each layer whose output a gated MLP reads; None: no gated MLP behind a norm
    "llama": "post_attention_layernorm",
    "mistral": "post_attention_layernorm",
    "qwen2": "post_attention_layernorm",
    "qwen3": "post_attention_layernorm",
    "gemma": "post_attention_layernorm",
    "phi3": "post_attention_layernorm",
    "gemma2": "pre_feedforward_layernorm",
    "gemma3_text": "pre_feedforward_layernorm",
    "olmo2": None,  # its norms sit on the branch outputs; the MLP reads the raw residual
    "olmo": "post_attention_layernorm",
}


@pytest.mark.parametrize("case", [*FAMILY_CASES, *DISCOVERED_CASES])
def test_norms_feeding_gated_mlps_across_the_table_and_discovery(case):
    model = build(tiny_family_config(case))
    site = GATED_MLP_INPUT.get(case)
    names = norms_feeding_gated_mlps(model)
    if site is None:
        assert names == []
        return
    assert len(names) == 2 and all(name.endswith(f".{i}.{site}") for i, name in enumerate(names))
    kept = {
        name
        for name, layer in tapered_norms(patch_model(model, TaperNormConfig.paper(keep_norms=names)), include_kept=True)
        if not layer.tapered
    }
    assert set(names) < kept
