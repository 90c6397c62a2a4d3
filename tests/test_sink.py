"""The attention-sink prefix: sink positions stay normalized, fold into stored keys/values, reload both ways."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, TaperStateError, export_folded, fold_model, patch_model
from hf_tapernorm.layers.sink import set_sink_tokens, sink_prefix, sink_token_ids_of
from hf_tapernorm.layers.taper_norm import tapered_norms
from tests.conftest import build, random_batches, run_without_hf_tapernorm, tiny_family_config, tiny_llama_config
from tests.helpers import TEXT as BOS_TEXT
from tests.helpers import relative, tapered
from tests.helpers import sink_tapered as bos_sink_tapered
from tests.helpers import with_sink as with_bos_sink

SINK = [5]


def with_sink(ids: torch.Tensor, sink=SINK) -> torch.Tensor:
    return torch.cat([torch.tensor(sink).expand(ids.shape[0], -1), ids], dim=1)


def sink_tapered(kind: str, sink=SINK, scope: str = "internal") -> torch.nn.Module:
    """A tiny patched model at g = 0 (calibrated on sink-first batches, then perturbed), sink kept normalized."""
    return tapered(kind, scope, sink_token_ids=sink)


IDS = random_batches(n=1, batch=2, length=10, seed=3)[0]


def test_sink_positions_stay_normalized_at_every_gate():
    model = sink_tapered("llama")
    reference = build(tiny_llama_config()).eval()
    with torch.no_grad():
        tapered = model(with_sink(IDS)).logits
        normalized = reference(with_sink(IDS)).logits
    # Position 0 attends only to itself and takes the normalized branch everywhere: exactly the original.
    assert torch.allclose(tapered[:, 0], normalized[:, 0], atol=1e-5)
    assert not torch.allclose(tapered[:, 1:], normalized[:, 1:], atol=1e-3)


def test_sink_ids_live_in_the_config_and_must_agree_with_the_layers():
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(sink_token_ids=[5, 6]))
    assert model.tapernorm_config.sink_token_ids == [5, 6]
    assert {layer.sink_tokens for _, layer in tapered_norms(model)} == {2}
    assert sink_token_ids_of(model) == [5, 6]
    next(layer for _, layer in tapered_norms(model)).sink_tokens = 1
    with pytest.raises(TaperStateError, match=r"disagree with its TaperNormConfig \(2 sink token"):
        sink_token_ids_of(model)
    set_sink_tokens(model, None)
    assert model.tapernorm_config.sink_token_ids == [] and sink_token_ids_of(model) == []
    assert sink_token_ids_of(build(tiny_llama_config())) == []  # an unpatched model has none


def test_sink_prefix_is_the_original_models_cache_on_the_sink_and_restores_gates():
    model = sink_tapered("llama", sink=[5, 9])
    keys, values = sink_prefix(model, [5, 9])
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert keys.shape == values.shape == (config.num_hidden_layers, config.num_key_value_heads, 2, head_dim)
    reference = build(tiny_llama_config()).eval()
    with torch.no_grad():
        cache = reference(input_ids=torch.tensor([[5, 9]]), use_cache=True).cache
    assert torch.allclose(keys[1], cache.layers[1].keys[0], atol=1e-6)
    assert torch.allclose(values[0], cache.layers[0].values[0], atol=1e-6)
    assert {float(layer.gate) for _, layer in tapered_norms(model)} == {0.0} and not model.training


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("scope", ["internal", "all"])
def test_folded_model_with_sink_prefix_equals_unfolded_on_sink_plus_text(kind, scope):
    model = sink_tapered(kind, scope=scope)
    folded = fold_model(model)
    assert folded.config.sink_token_ids == SINK
    assert folded.fold_report.max_rel_diff <= 1e-5
    with torch.no_grad():
        expected = model(with_sink(IDS)).logits[:, 1:]
        assert torch.allclose(folded(input_ids=IDS).logits, expected, atol=1e-4)
        # Caller-given position ids and a 2D mask count from the first real token.
        positions = torch.arange(IDS.shape[1]).expand_as(IDS)
        out = folded(input_ids=IDS, attention_mask=torch.ones_like(IDS), position_ids=positions, use_cache=False)
        assert torch.allclose(out.logits, expected, atol=1e-4) and out.cache is None
        # Incremental decoding continues the cache that holds the sink.
        first = folded(input_ids=IDS[:, :6], use_cache=True)
        assert first.cache.get_seq_length() == 6 + len(SINK)
        rest = folded(input_ids=IDS[:, 6:], cache=first.cache, attention_mask=torch.ones_like(IDS))
        assert torch.allclose(rest.logits, expected[:, 6:], atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sink_export_generates_like_the_unfolded_model_and_reloads_both_ways(kind, tmp_path):
    model = sink_tapered(kind)
    folded = fold_model(model)
    out = export_folded(folded, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["sink_token_ids"] == SINK and config["tapernorm_config"]["sink_token_ids"] == SINK
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.sink_keys, folded.sink_keys)
    with torch.no_grad():
        unfolded = model.generate(with_sink(IDS), max_new_tokens=8, do_sample=False)[:, len(SINK) :]
        greedy = reloaded.generate(IDS, max_new_tokens=8, do_sample=False)
        assert torch.equal(greedy, unfolded)
        assert torch.equal(reloaded.generate(IDS, max_new_tokens=8, do_sample=False, use_cache=False), unfolded)
        expected_logits = folded(input_ids=IDS).logits
    results = run_without_hf_tapernorm(tmp_path, [str(out)], IDS)
    assert torch.allclose(results[str(out)]["logits"], expected_logits, atol=1e-6)  # other thread count: rounding
    assert torch.equal(results[str(out)]["greedy"], greedy)


def test_left_padded_batch_generation_with_sink():
    folded = fold_model(sink_tapered("llama"))
    short = IDS[1:, 3:]
    padded = torch.cat([torch.zeros(1, 3, dtype=IDS.dtype), short], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=IDS.dtype), torch.ones_like(short)], dim=1)
    with torch.no_grad():
        alone = folded.generate(short, max_new_tokens=6, do_sample=False)
        batched = folded.generate(
            torch.cat([IDS[:1], padded]),
            attention_mask=torch.cat([torch.ones_like(IDS[:1]), mask]),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(batched[1, 3:], alone[0])


def test_heldout_loss_counts_the_same_targets_for_unfolded_and_folded_models():
    from hf_tapernorm.evaluation.scores import heldout_loss

    model = sink_tapered("llama")
    folded = fold_model(model)
    blocks = with_sink(random_batches(n=1, batch=5, length=15, seed=4)[0])
    unfolded_loss = heldout_loss(model, blocks, batch_size=2, prefix_length=1)
    folded_loss = heldout_loss(folded, blocks, batch_size=2, prefix_length=1)
    assert unfolded_loss["tokens"] == folded_loss["tokens"] == 5 * 14
    assert folded_loss["loss"] == pytest.approx(unfolded_loss["loss"], rel=1e-5)
    # Independent computation: mean CE of the text tokens after the first, from the unfolded logits.
    with torch.no_grad():
        logits = model(blocks).logits[:, 1:-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 2:].reshape(-1))
    assert unfolded_loss["loss"] == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match=r"holds the sink token\(s\) \[5\] as a cache prefix"):
        heldout_loss(folded, blocks[:, 1:], prefix_length=0)


def test_model_card_says_the_sink_is_stored_and_may_lead_the_input():
    folded = fold_model(sink_tapered("llama"))
    card = folded.model_card
    assert "| Attention-sink prefix | token id(s) [5]: keys/values of 1 position(s) stored per layer |" in card
    assert "**The attention sink [5] is stored.**" in card and "model(**tokenizer(text))" in card


@pytest.mark.slow
def test_smollm2_sink_export_generates_like_the_unfolded_model(tmp_path):
    """SmolLM2-135M cut to 4 layers (untrained at g = 0 the full model is not finite), BOS sink, every
    internal norm folded: greedy text from the prompt alone equals the tapered model's from BOS + prompt."""
    from tests.conftest import smollm2_sink_model

    model, tokenizer, tokens, bos = smollm2_sink_model()
    folded = fold_model(model, probe=tokens[None, 800:864])
    prompt = tokenizer(
        "import textwrap\n\ndef wrap(text, width=70):\n", return_tensors="pt", add_special_tokens=False
    ).input_ids
    with torch.no_grad():
        unfolded = model.generate(with_sink(prompt, [bos]), max_new_tokens=32, do_sample=False)[:, 1:]
    out = export_folded(folded, tmp_path / "smollm2-4-sink")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(reloaded.generate(prompt, max_new_tokens=32, do_sample=False), unfolded)
    print(f"\nSmolLM2-135M 4 layers, BOS sink (fp32): fold check {folded.fold_report.to_dict()}")
    assert folded.fold_report.max_rel_diff <= 1e-5
    results = run_without_hf_tapernorm(tmp_path, [str(out)], prompt, new_tokens=32)
    assert torch.equal(results[str(out)]["greedy"], unfolded)


def test_a_chunk_that_continues_a_cache_has_no_sink_position():
    model = sink_tapered("llama")
    ids = with_sink(IDS)
    with torch.no_grad():
        full = model(ids).logits
        first = model(input_ids=ids[:, :5], use_cache=True)
        # A multi-token chunk on top of the cache: its first token is ordinary text, not the sink.
        rest = model(input_ids=ids[:, 5:], cache=first.cache).logits
    torch.testing.assert_close(rest, full[:, 5:], atol=1e-5, rtol=1e-5)
    assert all(layer.sink_active for _, layer in tapered_norms(model)) is False
    with torch.no_grad():
        model(ids)  # a fresh forward holds the sink again
    assert all(layer.sink_active for _, layer in tapered_norms(model))


# ----------------------------------------------------------------------------- OPT: a flattened MLP input, project_out
@torch.no_grad()
def test_every_sequence_of_an_opt_batch_keeps_its_sink_normalized():
    """OPT's MLP norm reads its input flattened to ``[batch * seq, hidden]``: the patched norm took the first row
    alone for the sink, so every other sequence's sink took the tapered branch (and entered calibration), and the
    fold check of a trained OPT sink model failed on its 2-sequence probe. Each sequence's sink is its own now:
    row 1 of a batch gives the logits it gives alone, its sink those of the unpatched model."""
    model = bos_sink_tapered("opt")
    reference = build(tiny_family_config("opt")).eval()
    ids = with_bos_sink(BOS_TEXT)
    together = model(ids).logits
    alone = model(ids[1:]).logits
    assert relative(together[1:], alone) < 1e-5
    assert relative(together[:, :1], reference(ids).logits[:, :1]) < 1e-5


@torch.no_grad()
def test_an_opt_with_project_out_folds_a_sink_with_its_narrower_last_hidden_state(tmp_path):
    """OPT with word_embed_proj_dim != hidden_size (facebook/opt-350m's shape) returns its last hidden state after
    project_out, narrower than the others: storing the sink's hidden states raised "stack expects each tensor to be
    equal size" after a whole training run. Now they are stored padded to the widest and read back at each entry's
    width: the export gives the tapered model's logits, hidden states and generated tokens on [sink] + text."""
    model = bos_sink_tapered("opt-project_out")
    folded = fold_model(model)
    assert folded.fold_report.max_rel_diff < 1e-5
    ids = with_bos_sink(BOS_TEXT)
    expected = model(ids, output_hidden_states=True)
    for candidate in (folded, AutoModelForCausalLM.from_pretrained(export_folded(folded, tmp_path / "export"))):
        actual = candidate.eval()(ids, output_hidden_states=True)
        assert relative(actual.logits, expected.logits) < 1e-5
        assert [h.shape[-1] for h in actual.hidden_states] == [32, 32, 16]
        for got, want in zip(actual.hidden_states, expected.hidden_states):
            assert relative(got, want) < 1e-5
        generated = candidate.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(generated, model.generate(ids, max_new_tokens=5, do_sample=False))
