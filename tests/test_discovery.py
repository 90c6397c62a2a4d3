import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, fold_model, patch_model
from hf_tapernorm.architectures.discovery import DiscoveryError, discover_architecture
from hf_tapernorm.architectures.styles import NormStyle
from hf_tapernorm.architectures.table import NormSite, architecture_for
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import calibrate
from tests.conftest import (
    _FAMILY_COMMON,
    _GQA,
    FAMILY_CASES,
    build,
    random_batches,
    tiny_family_config,
    tiny_llama_config,
)


def _normalized(arch):
    return (
        arch.style,
        arch.layers,
        tuple(sorted(arch.sites, key=lambda site: site.path)),
        arch.final_norm,
        arch.lm_head,
        arch.gated_mlp,
    )


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_discovery_reproduces_the_table(case):
    config = tiny_family_config(case)
    model = build(config)
    model.train()
    discovered = discover_architecture(model)
    assert _normalized(discovered) == _normalized(architecture_for(config.model_type, config))
    assert discovered.model_type == config.model_type
    assert model.training  # the probe runs in eval mode and restores the mode
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_discovery_reads_a_patched_model_the_same_way():
    config = tiny_family_config("qwen3")
    model = patch_model(build(config), TaperNormConfig.paper(scope="all"))
    assert _normalized(discover_architecture(model)) == _normalized(architecture_for("qwen3"))


def test_discovery_describes_architectures_absent_from_the_table():
    olmo2 = discover_architecture(build(tiny_family_config("olmo2")))
    assert olmo2.style is NormStyle.RMS and olmo2.final_norm == "norm" and olmo2.lm_head == "lm_head"
    assert olmo2.sites == (
        NormSite("post_attention_layernorm", ("self_attn.o_proj",), "output", "attention_output"),
        NormSite("post_feedforward_layernorm", ("mlp.down_proj",), "output", "mlp_output"),
        NormSite("self_attn.k_norm", ("self_attn.k_proj",), "output", "qk"),
        NormSite("self_attn.q_norm", ("self_attn.q_proj",), "output", "qk"),
    )
    assert olmo2.gated_mlp
    starcoder2 = discover_architecture(build(tiny_family_config("starcoder2")))
    assert starcoder2.style is NormStyle.LAYER
    assert starcoder2.sites == (
        NormSite("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), role="attention"),
        NormSite("post_attention_layernorm", ("mlp.c_fc",), role="mlp"),
    )
    assert not starcoder2.gated_mlp


def test_discovery_handles_norms_without_parameters_or_an_eps_attribute():
    model = build(tiny_family_config("olmo"))  # OlmoLayerNorm: no weight, no bias, eps 1e-5 hard-coded in forward
    norm = model.model.layers[0].input_layernorm
    assert not list(norm.parameters()) and not hasattr(norm, "eps")
    arch = discover_architecture(model)
    assert arch.style is NormStyle.LAYER and arch.gated_mlp
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        before = model(ids).logits
    patch_model(model, TaperNormConfig.paper())
    assert {layer.eps for _, layer in tapered_norms(model, include_kept=True)} == {1e-5}  # measured from one forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    model.train()
    with torch.no_grad():
        model(ids)
    calibrate(model)
    set_gate(model, 0.0)
    assert fold_model(model).fold_report.max_rel_diff <= 1e-5


def test_patch_model_falls_back_to_discovery_and_says_so(caplog):
    model = build(tiny_family_config("olmo2"))
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        before = model(ids).logits
    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        patch_model(model, TaperNormConfig.paper(scope="all"))
    assert "model_type 'olmo2' has no table entry; discovered its norms automatically" in caplog.text
    assert len(dict(tapered_norms(model, include_kept=True))) == 2 * 4 + 1
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    model.train()
    with torch.no_grad():
        model(random_batches(n=1)[0])
    calibrate(model)
    set_gate(model, 0.0)
    model.eval()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        folded = fold_model(model)  # built-in check against the unfolded g = 0 model (fp32: 1e-4)
    assert "has no table entry" not in caplog.text  # the description discovered at patch time is reused
    assert type(folded).__name__ == "TaperNormOlmo2ForCausalLM"
    assert folded.config.model_type == "tapernorm_olmo2"
    assert folded.fold_report.max_rel_diff <= 1e-5


def test_same_formula_with_other_rounding_is_accepted_with_a_warning(caplog):
    # OLMo2's RMSNorm multiplies by w in fp32 and casts last: in bf16 that differs from Llama's order by rounding.
    model = build(tiny_family_config("olmo2"), dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        assert discover_architecture(model).style is NormStyle.RMS
    assert "norm class(es) Olmo2RMSNorm match the TaperNorm arithmetic only up to rounding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        discover_architecture(build(tiny_family_config("olmo2")))
    assert "rounding" not in caplog.text  # fp32: bit for bit


class _GeluBeforeMLP(nn.Module):
    """An MLP that applies GELU to the norm output before its projections: not foldable."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(F.gelu(x))


def test_a_norm_feeding_a_non_linear_op_is_refused_by_name():
    model = build(tiny_llama_config())
    model.model.layers[1].mlp = _GeluBeforeMLP(model.model.layers[1].mlp)
    with pytest.raises(
        DiscoveryError,
        match=r"norm 'model\.layers\.1\.post_attention_layernorm' cannot be folded: its output reaches the op "
        r"'gelu', which is not a linear projection",
    ):
        discover_architecture(model)


def test_post_ln_and_embedding_norms_are_refused_by_name():
    opt = build(tiny_family_config("opt", do_layer_norm_before=False))
    with pytest.raises(
        DiscoveryError,
        match=r"norm 'model\.decoder\.layers\.0\.self_attn_layer_norm' cannot be folded: its output reaches "
        r"the op 'add'",
    ):
        discover_architecture(opt)
    with pytest.raises(ValueError, match=r"OPT with do_layer_norm_before=False \(post-LN"):
        patch_model(opt, TaperNormConfig.paper())
    bloom = build(AutoConfig.for_model("bloom", vocab_size=128, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(
        DiscoveryError,
        match=r"model_type 'bloom' is not supported by hf_tapernorm; supported model types: .*; automatic discovery "
        r"refused it too: norm 'transformer\.word_embeddings_layernorm' cannot be folded: its output reaches the "
        r"norm 'transformer\.h\.0\.input_layernorm', which is not a linear projection",
    ):
        patch_model(bloom, TaperNormConfig.paper())
    assert not dict(tapered_norms(bloom, include_kept=True))


def _tiny_auto_config(model_type, **extra):
    """A tiny config of a family transformers builds that neither the table nor conftest covers."""
    return AutoConfig.for_model(model_type, **{**_FAMILY_COMMON, **_GQA, **extra})


def test_a_layernorm_subclass_with_another_gain_is_refused_by_class():
    """Nemotron's LayerNorm1P subclasses nn.LayerNorm but multiplies by ``weight + 1``: discovery took it for a plain
    LayerNorm (by its type), so patch_model was accepted with gate-1 logits off and only fold_model failed, after
    training. Now every discovered norm but an exact nn.LayerNorm is checked numerically against what its TaperNorm
    computes at gate 1, and this one is refused before the model is touched, naming its class."""
    model = build(_tiny_auto_config("nemotron", head_dim=8))
    with pytest.raises(DiscoveryError) as error:
        discover_architecture(model)
    assert str(error.value) == (
        "norm 'model.layers.0.input_layernorm' (NemotronLayerNorm1P) computes something other than weight * "
        "normalized x in the forms TaperNorm reproduces: RMSNorm (w * x / rms), Gemma's RMSNorm ((1 + w) * x / rms), "
        "LayerNorm (w * (x - mean) / std + b); a TaperNorm in its place would change the model's outputs, so "
        "hf_tapernorm cannot replace it"
    )
    with pytest.raises(DiscoveryError, match=r"^model_type 'nemotron' is not supported by hf_tapernorm; .*"):
        patch_model(model)
    assert not dict(tapered_norms(model, include_kept=True))


class _PlainLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that computes what nn.LayerNorm does (a family's own class name)."""


def test_a_discovered_layernorm_family_still_patches_exactly():
    """The numeric check that refuses Nemotron's LayerNorm1P accepts an ordinary discovered family: StarCoder2's
    nn.LayerNorm, and the same norms as a subclass with nn.LayerNorm's arithmetic, patch with unchanged logits."""
    ids = random_batches(n=1)[0]
    for subclass in (False, True):
        model = build(tiny_family_config("starcoder2"))
        if subclass:
            for name, norm in list(model.named_modules()):
                if type(norm) is nn.LayerNorm:
                    plain = _PlainLayerNorm(norm.normalized_shape, eps=norm.eps)
                    plain.load_state_dict(norm.state_dict())
                    model.set_submodule(name, plain)
        with torch.no_grad():
            before = model(ids).logits
        assert discover_architecture(model).style is NormStyle.LAYER
        patch_model(model, TaperNormConfig.paper(scope="all"))
        assert len(dict(tapered_norms(model, include_kept=True))) == 2 * 2 + 1
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)


_MOE_CASES = {
    "mixtral": ("MixtralSparseMoeBlock", "MixtralTopKRouter", dict(num_local_experts=2)),
    "olmoe": ("OlmoeSparseMoeBlock", "OlmoeTopKRouter", dict(num_experts=2, num_experts_per_tok=1)),
    "qwen2_moe": (
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeTopKRouter",
        dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    ),
}


@pytest.mark.parametrize("model_type", sorted(_MOE_CASES))
def test_a_mixture_of_experts_block_is_refused_by_name(model_type):
    """A mixture-of-experts model was refused (rightly: it is not supported) with a message that contradicted itself:
    "its output reaches the op 'linear', which is not a linear projection" (the router's F.linear on its own weight).
    Now the refusal names the mixture-of-experts block and the part of it that reads the norm, and says what to do."""
    block, router, extra = _MOE_CASES[model_type]
    model = build(_tiny_auto_config(model_type, **extra))
    with pytest.raises(DiscoveryError) as error:
        discover_architecture(model)
    assert str(error.value) == (
        f"norm 'model.layers.0.post_attention_layernorm' feeds the mixture-of-experts block 'model.layers.0.mlp' "
        f"({block}), which a norm cannot be folded into: 'model.layers.0.mlp.gate' ({router}) reads it with the op "
        "'linear', not through a linear projection module; mixture-of-experts models are not supported, taper a "
        "dense model"
    )
    with pytest.raises(DiscoveryError, match=rf"^model_type '{model_type}' is not supported by hf_tapernorm; "):
        patch_model(model)


# ============================================================================= a model without its weights
@pytest.mark.parametrize("case", ["olmo2", "starcoder2", "olmo"])
def test_a_model_on_the_meta_device_is_described_as_with_its_weights(case):
    """`hf-tapernorm taper` plans its patch on the model built from its config on the meta device, and discovery's
    probe forward failed there for every family outside the table ("Tensor.item() cannot be called on meta tensors",
    in transformers' mask code): the CLI refused them all. Discovery now probes a small stand-in with weights (two
    layers, a small vocabulary) and describes the meta model as the model with its weights."""
    from hf_tapernorm.architectures.sites import architecture_of
    from hf_tapernorm.layers.patching import plan_patch

    config = tiny_family_config(case, num_hidden_layers=3)
    with torch.device("meta"):
        weightless = AutoModelForCausalLM.from_config(config)
    assert _normalized(architecture_of(weightless)) == _normalized(discover_architecture(build(config)))
    assert all(p.is_meta for p in weightless.parameters())  # the stand-in is a copy: the model stays as it was
    plan_patch(weightless, TaperNormConfig.for_model(weightless))  # the preflight's plan: every norm of 3 layers


def test_a_weightless_layernorm_subclass_with_another_gain_is_refused_as_with_its_weights():
    """The stand-in's norm weights are drawn away from 0 and 1, so the formula check cannot pass by a coincidence of
    initial values: Nemotron's LayerNorm1P ((1 + w) * normalized x) is refused on the meta device as with weights."""
    from hf_tapernorm.architectures.sites import architecture_of

    config = AutoConfig.for_model(
        "nemotron", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    with torch.device("meta"):
        weightless = AutoModelForCausalLM.from_config(config)
    with pytest.raises(DiscoveryError, match=r"\(NemotronLayerNorm1P\) computes something other than weight"):
        architecture_of(weightless)


_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
_QWEN2_MOE = dict(_MOE, shared_expert_intermediate_size=16)
_GLM4_MOE = dict(
    n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, head_dim=8, n_group=1, topk_group=1
)
#: Mixture-of-experts models whose first layers are dense: (model type, settings, the first sparse layer).
_DENSE_FIRST_MOE_CASES = {
    "qwen2_moe decoder_sparse_step=3": ("qwen2_moe", dict(_QWEN2_MOE, num_hidden_layers=3, decoder_sparse_step=3), 2),
    "qwen2_moe mlp_only_layers=[0, 1]": ("qwen2_moe", dict(_QWEN2_MOE, num_hidden_layers=4, mlp_only_layers=[0, 1]), 2),
    "qwen3_moe decoder_sparse_step=4": (
        "qwen3_moe",
        dict(_MOE, num_hidden_layers=4, decoder_sparse_step=4, head_dim=8),
        3,
    ),
    "glm4_moe first_k_dense_replace=2": ("glm4_moe", dict(_GLM4_MOE, num_hidden_layers=4, first_k_dense_replace=2), 2),
    "ernie4_5_moe moe_layer_start_index=2": (
        "ernie4_5_moe",
        dict(num_hidden_layers=4, moe_layer_start_index=2, moe_num_experts=2, moe_k=1, moe_intermediate_size=16),
        2,
    ),
    # mlp_only_layers as long as the layer list: a 2-layer config cut it to [2, 5] (layer 0 sparse, unlike the model)
    "qwen2_moe mlp_only_layers=[2, 5, 0]": (
        "qwen2_moe",
        dict(_QWEN2_MOE, num_hidden_layers=3, mlp_only_layers=[2, 5, 0]),
        1,
    ),
}


def _layer_kinds(model):
    """Each decoder layer's module tree: (name, class) of the layer and of each submodule."""
    return [tuple((n, type(m).__name__) for n, m in layer.named_modules()) for layer in model.model.layers]


@pytest.mark.parametrize("case", sorted(_DENSE_FIRST_MOE_CASES))
def test_a_mixture_of_experts_model_with_dense_first_layers_is_refused_on_the_meta_device(case):
    """The stand-in kept the first two decoder layers, both dense in these models, so the meta-device plan (the CLI's
    preflight) accepted them, and taper refused only after it had loaded the weights and written a failed run folder.
    The stand-in now holds one layer of every kind the model has (its module tree, read from the meta model), so the
    meta model is refused as the model with its weights is, naming the same first sparse layer."""
    from hf_tapernorm.architectures.sites import architecture_of
    from hf_tapernorm.architectures.stand_in import runnable_stand_in

    model_type, extra, sparse = _DENSE_FIRST_MOE_CASES[case]
    config = _tiny_auto_config(model_type, **extra)
    with pytest.raises(DiscoveryError) as with_weights:
        architecture_of(build(config))
    with torch.device("meta"):
        weightless = AutoModelForCausalLM.from_config(config)
    with pytest.raises(DiscoveryError) as on_meta:
        architecture_of(weightless)
    assert str(on_meta.value) == str(with_weights.value)
    assert f"feeds the mixture-of-experts block 'model.layers.{sparse}.mlp' (" in str(on_meta.value)
    stand_in = runnable_stand_in(weightless)
    model_layers, kept = _layer_kinds(weightless), _layer_kinds(stand_in)
    assert kept == model_layers[: len(kept)] and set(kept) == set(model_layers)  # the model's first layers, every kind


def test_the_stand_in_keeps_two_layers_where_every_layer_is_alike():
    """Holding every layer kind costs nothing where the layers are all alike: the stand-in stays two layers."""
    from hf_tapernorm.architectures.stand_in import STAND_IN_LAYERS, runnable_stand_in

    with torch.device("meta"):
        weightless = AutoModelForCausalLM.from_config(tiny_family_config("olmo2", num_hidden_layers=6))
    assert len(runnable_stand_in(weightless).model.layers) == STAND_IN_LAYERS == 2


def test_the_cli_tapers_a_family_outside_the_table(tmp_path):
    """The whole job on a discovered family (OLMo2): taper trains, folds, reloads the export and writes the report;
    fold of its checkpoint exports again. Both refused the family before (the meta-device plan)."""
    from tests.conftest import char_tokenizer
    from tests.helpers import one_model_workspace, run_main, short_fold_argv, short_taper_argv

    ws = one_model_workspace(tmp_path / "ws")
    config = tiny_family_config("olmo2", bos_token_id=127, eos_token_id=127, pad_token_id=None)
    build(config).save_pretrained(ws / "olmo2")
    char_tokenizer().save_pretrained(ws / "olmo2")
    code, stdout, stderr = run_main(short_taper_argv(ws, tmp_path / "run", model=str(ws / "olmo2")))
    assert code == 0, stderr[-2000:]
    assert "export: " in stdout and "(reloaded: True)" in stdout
    code, _, stderr = run_main(short_fold_argv(tmp_path / "run" / "tapered", tmp_path / "export"))
    assert code == 0, stderr[-2000:]
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_the_cli_refuses_a_moe_model_with_dense_first_layers_before_loading_it(tmp_path):
    """taper of a qwen2_moe whose first two layers are dense (decoder_sparse_step=3) passed the preflight, packed the
    data, loaded the weights and then refused, leaving a run folder whose report.json said "failed". The preflight's
    plan now sees the sparse layer: one line, exit status 2, and no run folder."""
    from tests.conftest import char_tokenizer
    from tests.helpers import error_of, one_model_workspace, short_taper_argv

    ws = one_model_workspace(tmp_path / "ws")
    model_type, extra, _ = _DENSE_FIRST_MOE_CASES["qwen2_moe decoder_sparse_step=3"]
    build(_tiny_auto_config(model_type, **extra)).save_pretrained(ws / "moe")
    char_tokenizer().save_pretrained(ws / "moe")
    message = error_of(short_taper_argv(ws, tmp_path / "run", model=str(ws / "moe")))
    assert message.startswith("hf-tapernorm taper: error: model_type 'qwen2_moe' is not supported by hf_tapernorm; ")
    assert message.endswith(
        "automatic discovery refused it too: norm 'model.layers.2.post_attention_layernorm' feeds the "
        "mixture-of-experts block 'model.layers.2.mlp' (Qwen2MoeSparseMoeBlock), which a norm cannot be folded into: "
        "'model.layers.2.mlp.gate' (Qwen2MoeTopKRouter) reads it with the op 'linear', not through a linear "
        "projection module; mixture-of-experts models are not supported, taper a dense model"
    )
    assert not (tmp_path / "run").exists()
