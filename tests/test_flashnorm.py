"""FlashNorm: a norm's weight folded into the modules it feeds, a weightless norm left; exact, without training.

``flashnorm_model`` is the peer ``hf-tapernorm bench`` measures exports against; ``fold_model`` moves the
weights of an export's kept RMS pre-norms the same way. Checked here: logits equal, each weight where it
belongs, reloads with and without hf_tapernorm, older exports with weighted kept norms still load, and an
export never runs more aten operations per generated token than the FlashNorm fold of its original.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_tapernorm import TaperNormConfig, TaperStateError, export_folded, fold_model, patch_model
from hf_tapernorm.architectures.sites import norm_sites
from hf_tapernorm.bench import variants as var
from hf_tapernorm.bench.arguments import Case
from hf_tapernorm.bench.measure import op_counts
from hf_tapernorm.bench.workloads import inference_workload
from hf_tapernorm.export import flashnorm_model
from hf_tapernorm.export.modeling_folded import WeightlessRMSNorm
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import calibrate
from tests.conftest import (
    FAMILY_CASES,
    build,
    char_tokenizer,
    random_batches,
    run_without_hf_tapernorm,
    tiny_family_config,
    tiny_llama_config,
)
from tests.helpers import IDS, logits, relative_error, tapered

MLP_NORMS = ["model.layers.0.post_attention_layernorm", "model.layers.1.post_attention_layernorm"]


def _with_parameters(model: nn.Module) -> list[str]:
    """The pre-norms FlashNorm makes weightless: those with a weight or bias to give away."""
    sites = [site for site in norm_sites(model) if site.kind == "input"]
    return [site.path for site in sites if list(model.get_submodule(site.path).parameters(recurse=False))]


def _tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _default_recipe_at_g0(model: nn.Module, sink_token_ids=()) -> nn.Module:
    """``model`` patched with its default recipe, calibrated on random tokens and tapered to g = 0."""
    patched = patch_model(copy.deepcopy(model), TaperNormConfig.for_model(model, sink_token_ids=list(sink_token_ids)))
    sink = torch.tensor(list(sink_token_ids), dtype=torch.long)
    patched.train()
    with torch.no_grad():
        for ids in random_batches():
            patched(torch.cat([sink.expand(ids.shape[0], -1), ids], dim=1))
    calibrate(patched)
    set_gate(patched, 0.0)
    return patched.eval()


# ----------------------------------------------------------------------------- the peer: flashnorm_model
@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_flashnorm_logits_equal_the_originals_in_every_family(case):
    model = build(tiny_family_config(case))
    flash = flashnorm_model(model)
    assert flash.fold_report.max_rel_diff <= 1e-5
    assert relative_error(logits(flash, IDS), logits(model, IDS)) <= 1e-5
    weightless = _with_parameters(model)
    assert list(flash.config.weightless_norms) == weightless and flash.config.folded_norms == []
    assert flash.config.kept_norms == [site.path for site in norm_sites(model)]
    assert all(not list(flash.get_submodule(path).parameters()) for path in weightless)
    # q/k norms and post-norms keep their weights (RoPE or the residual sum comes after them)
    for site in norm_sites(model):
        if site.kind != "input":
            torch.testing.assert_close(
                dict(flash.get_submodule(site.path).named_parameters()),
                dict(model.get_submodule(site.path).named_parameters()),
            )
    untied = _tied(model) and norm_sites(model)[-1].path in weightless
    assert flash.config.tied_head == ("untie" if untied else None)
    assert _tied(flash) == (_tied(model) and not untied)


@pytest.mark.parametrize("case", ["llama", "gemma", "gpt2"])
def test_flashnorm_moves_each_weight_into_the_modules_it_feeds(case):
    model = build(tiny_family_config(case))
    flash = flashnorm_model(model)
    if case == "gpt2":  # Conv1D ([in, out]): gamma scales the input rows, W^T beta joins the bias
        ln, attn = model.transformer.h[0].ln_1, model.transformer.h[0].attn.c_attn
        expected = attn.weight.double() * ln.weight.double()[:, None]
        torch.testing.assert_close(flash.transformer.h[0].attn.c_attn.weight.double(), expected, rtol=1e-6, atol=0)
        bias = attn.bias.double() + ln.bias.double() @ attn.weight.double()
        torch.testing.assert_close(flash.transformer.h[0].attn.c_attn.bias.double(), bias, rtol=1e-6, atol=1e-7)
        head = model.lm_head.weight.double()
        final = model.transformer.ln_f
        torch.testing.assert_close(flash.lm_head.weight.double(), head * final.weight.double(), rtol=1e-6, atol=0)
        torch.testing.assert_close(flash.lm_head.bias.double(), head @ final.bias.double(), rtol=1e-6, atol=1e-7)
        assert isinstance(flash.transformer.ln_f, nn.LayerNorm) and flash.transformer.ln_f.weight is None
        return
    gain = (lambda w: 1.0 + w.double()) if case == "gemma" else (lambda w: w.double())
    layer, moved = model.model.layers[1], flash.model.layers[1]
    for name in ("q_proj", "k_proj", "v_proj"):
        expected = getattr(layer.self_attn, name).weight.double() * gain(layer.input_layernorm.weight)
        torch.testing.assert_close(getattr(moved.self_attn, name).weight.double(), expected, rtol=1e-6, atol=0)
    for name in ("gate_proj", "up_proj"):
        expected = getattr(layer.mlp, name).weight.double() * gain(layer.post_attention_layernorm.weight)
        torch.testing.assert_close(getattr(moved.mlp, name).weight.double(), expected, rtol=1e-6, atol=0)
    expected = model.lm_head.weight.double() * gain(model.model.norm.weight)
    torch.testing.assert_close(flash.lm_head.weight.double(), expected, rtol=1e-6, atol=0)
    assert isinstance(flash.model.norm, WeightlessRMSNorm) and flash.model.norm.variance_epsilon == 1e-6


def test_flashnorm_refuses_a_patched_or_a_folded_model():
    model = tapered("llama", "internal")
    with pytest.raises(TaperStateError, match="is patched: flashnorm_model reads an unpatched model"):
        flashnorm_model(model)
    with pytest.raises(TaperStateError, match="is already folded"):
        flashnorm_model(fold_model(model))


def test_weightless_models_reload_with_and_without_hf_tapernorm(tmp_path):
    kept = fold_model(tapered("llama", keep_norms=["*.post_attention_layernorm"]))
    flash = flashnorm_model(build(tiny_llama_config(tie_word_embeddings=True)))
    folders, expected = [], {}
    for name, model in (("export", kept), ("flashnorm", flash)):
        folder = str(export_folded(model, tmp_path / name) if name == "export" else tmp_path / name)
        if name == "flashnorm":
            model.save_pretrained(folder)
        reloaded = AutoModelForCausalLM.from_pretrained(folder)
        assert reloaded.config.weightless_norms == model.config.weightless_norms
        assert torch.equal(logits(reloaded, IDS), logits(model, IDS))
        with torch.no_grad():
            expected[folder] = (logits(model, IDS), model.generate(IDS, max_new_tokens=8, do_sample=False))
        folders.append(folder)
    results = run_without_hf_tapernorm(tmp_path, folders, IDS)
    for folder in folders:
        assert results[folder]["class"].startswith("transformers_modules.")
        assert torch.equal(results[folder]["logits"], expected[folder][0])
        assert torch.equal(results[folder]["greedy"], expected[folder][1])


# ----------------------------------------------------------------------------- an export's kept norms
@pytest.mark.parametrize("case", ["llama", "gemma", "qwen3", "gemma2", "gpt2"])
def test_an_exports_kept_rms_pre_norms_are_weightless_and_it_equals_the_tapered_model(case):
    model = _default_recipe_at_g0(build(tiny_family_config(case)))
    folded = fold_model(model)
    assert folded.fold_report.max_rel_diff <= 1e-5
    assert relative_error(logits(folded, IDS), logits(model, IDS)) <= 1e-5
    sites = {site.path: site for site in norm_sites(model)}
    kept = {name: layer for name, layer in tapered_norms(model, include_kept=True) if not layer.tapered}
    assert kept and folded.config.kept_norms == list(kept)
    rms = case != "gpt2"  # a LayerNorm applies its affine in the same kernel: it keeps it
    weightless = [name for name in kept if sites[name].kind == "input" and rms]
    assert list(folded.config.weightless_norms) == weightless
    for name, layer in kept.items():
        module = folded.get_submodule(name)
        if name in weightless:
            assert isinstance(module, WeightlessRMSNorm) and module.variance_epsilon == layer.eps
        else:  # q/k norms (qwen3), post-norms (gemma2), LayerNorms (gpt2): their weights stay
            torch.testing.assert_close(module.weight, layer.weight, rtol=0, atol=0)
    final = norm_sites(model)[-1].path
    # A tied head stays tied only under a kept final norm that keeps its weight (a tapered one folds into it).
    assert folded.config.tie_word_embeddings == (_tied(model) and final in kept and final not in weightless)


def test_a_kept_norms_weight_moves_into_its_consumers():
    model = tapered("llama", keep_norms=["*.post_attention_layernorm"])
    folded = fold_model(model)
    assert folded.config.weightless_norms == {name: 1e-6 for name in [*MLP_NORMS, "model.norm"]}
    for index in (0, 1):
        gamma = model.model.layers[index].post_attention_layernorm.weight.double()
        for name in ("gate_proj", "up_proj"):
            expected = getattr(model.model.layers[index].mlp, name).weight.double() * gamma
            actual = getattr(folded.model.layers[index].mlp, name).weight.double()
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    expected = model.lm_head.weight.double() * model.model.norm.weight.double()
    torch.testing.assert_close(folded.lm_head.weight.double(), expected, rtol=1e-6, atol=0)


def test_a_kept_rms_final_norm_unties_a_tied_head_unless_the_tie_is_kept():
    model = tapered("llama", "internal", tie_word_embeddings=True)
    untied = fold_model(model)
    assert untied.config.weightless_norms == {"model.norm": 1e-6} and untied.config.tied_head == "untie"
    assert untied.config.tie_word_embeddings is False and not _tied(untied)
    kept = fold_model(model, tied_head="scale")
    assert kept.config.weightless_norms == {} and kept.config.tied_head == "scale" and _tied(kept)
    assert isinstance(kept.model.norm, LlamaRMSNorm)
    torch.testing.assert_close(kept.model.norm.weight, model.model.norm.weight, rtol=0, atol=0)
    for folded in (untied, kept):
        assert relative_error(logits(folded, IDS), logits(model, IDS)) <= 1e-5


def test_an_older_export_with_weighted_kept_norms_still_loads(tmp_path):
    # What fold_model wrote before kept norms went weightless: no weightless_norms in config.json, the kept
    # final norm with its weight, lm_head as it was.
    model = tapered("llama", "internal")
    folder = export_folded(fold_model(model), tmp_path / "old")
    config = json.loads((folder / "config.json").read_text())
    del config["weightless_norms"]
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = model.model.norm.weight.detach().clone()
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    old = AutoModelForCausalLM.from_pretrained(folder)
    assert old.config.weightless_norms == {} and isinstance(old.model.norm, LlamaRMSNorm)
    assert relative_error(logits(old, IDS), logits(model, IDS)) <= 1e-5


# ----------------------------------------------------------------------------- operations per generated token
def _ops_per_generated_token(model: nn.Module, ids: torch.Tensor) -> float:
    """The bench's own count: aten ops of its decode workload, per generated token."""
    case = Case("decode", 1, ids.shape[1], 4, "fp32", "cpu", 1, compiled=False)
    return op_counts(inference_workload(model, case, ids, None))["aten_ops"]


@pytest.mark.parametrize("case", ["llama", "gemma", "gpt2"])
def test_the_default_export_runs_no_more_ops_per_generated_token_than_flashnorm(case, tmp_path):
    model = build(tiny_family_config(case))
    specs = var.variant_specs(["original", "flashnorm", "folded"], ["recipe"])
    built = var.build_variants(model, specs, calibration_batches=random_batches(n=2), workdir=tmp_path)
    with_sink = fold_model(_default_recipe_at_g0(model, sink_token_ids=[127]))  # as `taper` exports it
    ids = random_batches(n=1, batch=1)[0]
    ops = {name: _ops_per_generated_token(variant, ids) for name, variant in built.items()}
    ops["export with sink"] = _ops_per_generated_token(with_sink, ids)
    assert ops["folded"] <= ops["flashnorm"] and ops["export with sink"] <= ops["flashnorm"], ops
    assert ops["folded"] < ops["original"], ops
    if case != "gpt2":  # an RMS weight is a product of its own: FlashNorm saves one per norm
        assert ops["flashnorm"] < ops["original"], ops


def test_transformer_lens_runs_a_weightless_norm_with_its_real_scale(tmp_path):
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    folder = export_folded(fold_model(tapered("llama", keep_norms=["*.post_attention_layernorm"])), tmp_path / "out")
    expected = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")(IDS).logits
    bridge = transformer_bridge(folder, tokenizer=char_tokenizer())
    logits, cache = bridge.run_with_cache(IDS)
    assert (logits - expected).abs().max().item() <= 1e-4
    # ln2 (post_attention_layernorm) and ln_final are weightless real norms: their scale is the input's RMS.
    for name, stream in (("blocks.1.ln2", "blocks.1.hook_resid_mid"), ("ln_final", "blocks.1.hook_resid_post")):
        rms = (cache[stream].pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(cache[f"{name}.hook_scale"], rms)
        torch.testing.assert_close(cache[f"{name}.hook_out"], cache[stream] / rms)
