import copy
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, LlamaModel

from hf_tapernorm import CalibrationError, ConfigurationError, TaperNormConfig, TaperStateError, patch_model
from hf_tapernorm.layers import TaperNorm, set_gate, tapered_norms
from hf_tapernorm.training import calibrate
from tests.conftest import build, random_batches, tiny_gpt2_config, tiny_llama_config


@pytest.mark.parametrize("scope,tapered,kept", [("internal", 4, 1), ("final", 1, 4), ("all", 5, 0)])
def test_patch_scopes(tiny_model, scope, tapered, kept):
    patch_model(tiny_model, TaperNormConfig.paper(scope=scope))
    layers = dict(tapered_norms(tiny_model, include_kept=True))
    assert len(layers) == 5
    assert sum(m.tapered for m in layers.values()) == tapered
    assert sum(not m.tapered for m in layers.values()) == kept
    assert all(name == m.site_name for name, m in layers.items())


@pytest.mark.parametrize("scope", ["internal", "all"])
def test_patched_logits_and_generation_are_identical(tiny_model, scope):
    ids = random_batches(n=1, batch=2, length=12)[0]
    with torch.no_grad():
        before = tiny_model(ids).logits
        generated_before = tiny_model.generate(ids, max_new_tokens=8, do_sample=False)
    patch_model(tiny_model, TaperNormConfig.paper(scope=scope))
    with torch.no_grad():
        after = tiny_model(ids).logits
        generated_after = tiny_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert (after - before).abs().max().item() == 0.0
    assert torch.equal(generated_before, generated_after)


def test_bf16_model_patches_exactly():
    model = build(tiny_llama_config(), dtype=torch.bfloat16)
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model, TaperNormConfig.paper(scope="all"))
        after = model(ids).logits
    assert after.dtype == torch.bfloat16
    assert torch.equal(before, after)
    assert all(
        m.taper_weight.dtype == torch.bfloat16 and m.gate.dtype == torch.float32
        for _, m in tapered_norms(model, include_kept=True)
    )


def test_bare_base_model_patches(caplog):
    """A base model patches (it trains so), with a WARNING that fold_model cannot fold it: that refusal came only at
    the fold, after training."""
    torch.manual_seed(0)
    base = LlamaModel(tiny_llama_config()).eval()
    ids = random_batches(n=1)[0]
    with torch.no_grad(), caplog.at_level("WARNING", logger="hf_tapernorm.layers.patching"):
        before = base(ids).last_hidden_state
        patch_model(base, TaperNormConfig.paper())
        after = base(ids).last_hidden_state
    assert torch.equal(before, after)
    assert caplog.messages == [
        "patch_model: LlamaModel has no LM head, so it trains patched but neither fold_model nor save_tapered takes "
        "it (they take a causal LM); to fold or save, patch the model AutoModelForCausalLM loads"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_tapernorm.layers.patching"):
        patch_model(LlamaForCausalLM(tiny_llama_config()), TaperNormConfig.paper())
    assert not caplog.messages
    assert [n for n, _ in tapered_norms(base)] == [
        "layers.0.input_layernorm",
        "layers.0.post_attention_layernorm",
        "layers.1.input_layernorm",
        "layers.1.post_attention_layernorm",
    ]


def test_tied_embeddings_survive_patching():
    model = build(tiny_gpt2_config())
    patch_model(model, TaperNormConfig.paper(scope="all"))
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gate_round_trip_after_calibration(tiny_model):
    patch_model(tiny_model, TaperNormConfig.paper())
    tiny_model.train()
    with torch.no_grad():
        for ids in random_batches():
            tiny_model(ids)
    values = calibrate(tiny_model)
    assert len(values) == 4 and all(v > 0 for v in values.values())
    set_gate(tiny_model, 0.0)
    assert all(float(m.gate) == 0.0 for _, m in tapered_norms(tiny_model))
    assert all(float(m.gate) == 1.0 for _, m in tapered_norms(tiny_model, include_kept=True) if not m.tapered)
    tiny_model.eval()
    with torch.no_grad():
        logits = tiny_model(random_batches(n=1)[0]).logits
    assert torch.isfinite(logits).all()


def _calibrated(model):
    """``model`` patched with the paper's recipe, its statistics gathered in training mode and calibrated."""
    patch_model(model, TaperNormConfig.paper())
    model.train()
    with torch.no_grad():
        for ids in random_batches():
            model(ids)
    calibrate(model)
    return model


def test_state_dict_round_trip_of_a_patched_model(tiny_llama):
    _calibrated(tiny_llama)
    set_gate(tiny_llama, 0.3)
    state = tiny_llama.state_dict()
    assert "model.layers.0.input_layernorm.taper_weight" in state
    assert "model.layers.0.input_layernorm.c" in state
    fresh = patch_model(build(tiny_llama_config(), seed=5), TaperNormConfig.paper())
    fresh.load_state_dict(state)
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    ids = random_batches(n=1)[0]
    tiny_llama.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(tiny_llama(ids).logits, fresh(ids).logits)


def test_state_of_another_taper_layout_is_refused_before_it_loads(tiny_llama):
    """A patched model that keeps a norm, given the state of one that tapered it (another keep_norms), loaded its
    statistics and calibration into the kept norm without a word (a Trainer resume then failed on the optimizer's
    parameter groups). Every patched model refuses it now, before anything loads, and its copies do too."""
    state = _calibrated(tiny_llama).state_dict()
    keeps = TaperNormConfig.paper(keep_norms=["model.layers.1.*"])
    other = patch_model(build(tiny_llama_config(), seed=5), keeps)
    before = {key: value.clone() for key, value in other.state_dict().items()}
    expected = (
        "LlamaForCausalLM.load_state_dict: the state being loaded tapered other norms than the model's TaperNormConfig "
        "tapers (tapered in it, kept now: model.layers.1.input_layernorm, model.layers.1.post_attention_layernorm), "
        "so it was written with another TaperNormConfig; patch the model with that config (the tapernorm_config.json "
        "saved with it) to load it"
    )
    for model in (other, copy.deepcopy(other), pickle.loads(pickle.dumps(other))):
        with pytest.raises(TaperStateError) as caught:
            model.load_state_dict(state)
        assert str(caught.value) == expected
    assert all(torch.equal(before[key], value) for key, value in other.state_dict().items())
    # Parameters alone (no buffers: a weight average of two tapered models) hold taper_weight: a patched model's.
    second = patch_model(build(tiny_llama_config(), seed=8), TaperNormConfig.paper())
    averaged = {name: (p + q) / 2 for (name, p), q in zip(tiny_llama.named_parameters(), second.parameters())}
    second.load_state_dict(averaged, strict=False)
    assert torch.equal(second.state_dict()["model.norm.taper_weight"], averaged["model.norm.taper_weight"])
    # The same layout loads (the state_dict round trip above), and so does an untrained one, which tells nothing.
    patch_model(build(tiny_llama_config(), seed=6), keeps).load_state_dict(
        patch_model(build(tiny_llama_config(), seed=7), TaperNormConfig.paper()).state_dict()
    )


def test_errors_name_the_problem(tiny_llama):
    patch_model(tiny_llama, TaperNormConfig.paper())
    with pytest.raises(
        TaperStateError, match=r"already patched \(found a TaperNorm at 'model\.layers\.0\.input_layernorm'\)"
    ):
        patch_model(tiny_llama, TaperNormConfig.paper())
    with pytest.raises(ConfigurationError, match=r"gate must be in \[0, 1\], got -0.1"):
        set_gate(tiny_llama, -0.1)
    with pytest.raises(CalibrationError, match=r"before calibration: 4 layer\(s\) are uncalibrated"):
        set_gate(tiny_llama, 0.5)
    with pytest.raises(
        ConfigurationError, match="TaperNormConfig.scope must be one of internal, final, all, got 'everything'"
    ):
        TaperNormConfig.paper(scope="everything")


def test_unknown_model_type_is_refused_with_the_supported_list():
    from transformers import BertConfig

    model = AutoModelForCausalLM.from_config(
        BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            is_decoder=True,
        )
    )
    with pytest.raises(
        ValueError, match=r"model_type 'bert' is not supported by hf_tapernorm; supported model types: .*gpt2.*llama"
    ):
        patch_model(model, TaperNormConfig.paper())
    assert not any(isinstance(m, TaperNorm) for m in model.modules())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_does_not_count_twice(use_reentrant):
    ids = random_batches(n=1)[0]
    pending = {}
    for checkpointing in (False, True):
        model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model(ids, labels=ids).loss.backward()
        pending[checkpointing] = torch.stack([m.pending for _, m in tapered_norms(model)])
    assert pending[False][:, 2].tolist() == [ids.numel()] * 4
    torch.testing.assert_close(pending[True], pending[False], rtol=1e-6, atol=0)


def test_patch_model_on_a_module_that_is_no_hugging_face_model_is_one_clear_error():
    from torch import nn

    from hf_tapernorm import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="Linear has no config.model_type; hf_tapernorm expects"):
        patch_model(nn.Linear(2, 2))


def test_a_model_on_the_meta_device_is_refused_until_its_weights_load():
    """Building on the meta device, patching, then ``to_empty`` and ``load_state_dict`` of the plain weights was
    accepted, and the TaperNorm gains and state were uninitialised memory (the forward gave NaN). patch_model now
    refuses a model with meta parameters in one line; the same model patches exactly once its weights are loaded."""
    reference = build(tiny_llama_config())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(TaperStateError) as error:
        patch_model(model, TaperNormConfig.paper())
    assert str(error.value) == (
        "patch_model: LlamaForCausalLM has parameters on the meta device ('model.embed_tokens.weight'), so its "
        "weights are not loaded and the TaperNorm gains and state it would get hold no values (to_empty leaves them "
        "uninitialised, and a plain state dict does not fill them); load the weights first, then patch_model"
    )
    assert not any(isinstance(m, TaperNorm) for m in model.modules())
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.model.rotary_emb.inv_freq.copy_(reference.model.rotary_emb.inv_freq)  # a non-persistent buffer
    patch_model(model.eval(), TaperNormConfig.paper())
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
