"""Every way transformers 5 lets a caller pass state reaches a folded sink export and gives the unfolded answer.

The reference is the unfolded model at g = 0 on ``[sink] + text``; every comparison is a maximum relative
difference of logits (fp32). Tiny models of every gated family in the architecture table, whose recipe keeps
the BOS sink (docs/usage.md has the table of these ways).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_tapernorm import TaperNormConfig, fold_model, patch_model
from hf_tapernorm.app.showcase import count_aten_ops
from hf_tapernorm.architectures.table import ARCHITECTURES, architecture_for
from hf_tapernorm.layers import TaperNorm, set_gate
from hf_tapernorm.training import calibrate
from tests.conftest import FAMILY_CASES, build, random_batches, tiny_family_config
from tests.helpers import word_tokenizer

SINK = 1  # the tiny configs' bos_token_id
GATED = [
    case
    for case, (model_type, _) in FAMILY_CASES.items()
    if case == model_type
    and model_type in ARCHITECTURES
    and architecture_for(model_type, tiny_family_config(case)).gated_mlp
]
TEXT = random_batches(vocab=120, n=1, batch=2, length=12, seed=5)[0] + 3  # never the sink, pad or eos id
TOLERANCE = 1e-5
# gemma3_text's fp32 fold alone rounds to 2.2e-5 on TEXT (4e-7 in float64): the same with every way of passing state.
FOLD_ROUNDING = {"gemma3_text": 4e-5}


def test_every_gated_family_is_covered():
    assert set(GATED) == {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"}


def with_sink(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full((ids.shape[0], 1), SINK), ids], dim=1)


# Qwen 3's q/k norms stay real norms, as in the default recipe (tapered with a sink they fold too: tested below).
KEEP = {"qwen3": ["*.q_norm", "*.k_norm"]}


def sink_tapered(case: str, keep_norms=None) -> torch.nn.Module:
    """A tiny patched model at g = 0 with the BOS sink, calibrated on sink-first batches, then perturbed."""
    keep = KEEP.get(case, []) if keep_norms is None else keep_norms
    config = TaperNormConfig.paper(sink_token_ids=[SINK], keep_norms=keep)
    model = patch_model(build(tiny_family_config(case)), config)
    model.train()
    with torch.no_grad():
        for ids in random_batches(vocab=120, n=3):
            model(with_sink(ids + 3))
    calibrate(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered):
            layer.taper_weight.mul_(1 + 0.3 * torch.randn(layer.taper_weight.shape, generator=generator))
            layer.c.mul_(1.0 + 0.5 * torch.rand((), generator=generator))
    set_gate(model, 0.0)
    return model.eval()


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


@pytest.fixture(scope="module", params=GATED)
def pair(request):
    global TOLERANCE  # module-scoped per family: pytest runs each family's tests together
    model = sink_tapered(request.param)
    folded = fold_model(model)
    TOLERANCE = FOLD_ROUNDING.get(request.param, 1e-5)
    with torch.no_grad():
        expected = model(with_sink(TEXT)).logits
    return model, folded, expected


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_tapered_qk_norms_with_a_sink_fold_before_and_after_the_head_transpose(model_type):
    # Qwen 3 normalizes each head before the transpose ([batch, seq, heads, head_dim]), Gemma 3 after it
    # ([batch, heads, seq, head_dim]): the sink positions are cut along each site's own sequence axis.
    model = sink_tapered(model_type, keep_norms=[])
    folded = fold_model(model)
    assert folded.fold_report.max_rel_diff < 1e-4


@torch.no_grad()
def test_cache_keyword_and_the_older_past_key_values_continue_the_same_cache(pair):
    _, folded, expected = pair
    for name in ("cache", "past_key_values"):
        first = folded(input_ids=TEXT[:, :5], use_cache=True)
        logits = [first.logits]
        cache = first.cache
        for index in range(5, TEXT.shape[1]):  # a hand-written decoding loop, one token at a time
            step = folded(input_ids=TEXT[:, index : index + 1], use_cache=True, **{name: cache})
            cache = step.cache
            logits.append(step.logits)
        assert relative(torch.cat(logits, dim=1), expected[:, 1:]) <= TOLERANCE, name
        # and a multi-token chunk on a prefilled cache
        first = folded(input_ids=TEXT[:, :5], use_cache=True)
        rest = folded(input_ids=TEXT[:, 5:], **{name: first.cache})
        assert relative(rest.logits, expected[:, 6:]) <= TOLERANCE, name
    with pytest.raises(TypeError, match="pass the cache once"):
        folded(input_ids=TEXT[:, :1], cache=cache, past_key_values=cache)


@torch.no_grad()
def test_the_tapered_model_continues_a_cache_under_either_name(pair):
    model, _, expected = pair
    ids = with_sink(TEXT)
    for name in ("cache", "past_key_values"):  # its sink hook must see the continued cache under both names
        first = model(input_ids=ids[:, :5], use_cache=True)
        rest = model(input_ids=ids[:, 5:], **{name: first.cache})
        assert relative(rest.logits, expected[:, 5:]) <= TOLERANCE, name


@torch.no_grad()
def test_generate_with_and_without_a_user_built_cache(pair):
    model, folded, _ = pair
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    reference = model.generate(with_sink(TEXT), **options)
    for extra in ({}, {"cache": DynamicCache(config=folded.config)}, {"past_key_values": DynamicCache()}):
        out = folded.generate(TEXT, **options, **extra)
        assert torch.equal(out.sequences, reference.sequences[:, 1:]), extra
        assert relative(torch.stack(out.logits), torch.stack(reference.logits)) <= TOLERANCE, extra


@torch.no_grad()
def test_a_static_cache_is_refused_in_one_line_naming_the_dynamic_cache(pair):
    _, folded, _ = pair
    with pytest.raises(ValueError, match=r"cannot fill a static \(StaticCache\) cache; use the default dynamic cache"):
        folded.generate(TEXT, max_new_tokens=2, do_sample=False, cache_implementation="static")


@torch.no_grad()
def test_batched_generation_with_left_padding_and_an_attention_mask(pair):
    model, folded, _ = pair
    short, full = TEXT[1:, 2:5], TEXT[:1, :5]  # within gemma2/3's tiny sliding window (see docs/usage.md)
    padded = torch.cat([torch.cat([torch.zeros(1, 2, dtype=TEXT.dtype), short], dim=1), full])
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    options = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_logits=True)
    batched = folded.generate(padded, attention_mask=mask, pad_token_id=0, **options)
    for row, alone in ((0, short), (1, full)):
        reference = model.generate(with_sink(alone), **options)
        assert torch.equal(batched.sequences[row, -2:], reference.sequences[0, -2:])
        logits = torch.stack([step[row] for step in batched.logits])
        assert relative(logits, torch.stack([step[0] for step in reference.logits])) <= TOLERANCE
    # A forward with the same mask: each row's real positions equal the unfolded model on that row alone,
    # and a decoding step without position_ids continues each row from its own length.
    out = folded(input_ids=padded, attention_mask=mask, use_cache=True)
    assert relative(out.logits[0, 2:], model(with_sink(short)).logits[0, 1:]) <= TOLERANCE
    step = folded(input_ids=TEXT[:, 5:6], cache=out.cache, attention_mask=torch.cat([mask, mask[:, -1:]], 1))
    assert relative(step.logits[0], model(with_sink(torch.cat([short, TEXT[:1, 5:6]], 1))).logits[0, -1:]) <= TOLERANCE


@torch.no_grad()
def test_position_ids_logits_to_keep_inputs_embeds_and_return_dict_false(pair):
    _, folded, expected = pair
    text = expected[:, 1:]
    positions = torch.arange(TEXT.shape[1]).expand_as(TEXT)
    assert relative(folded(input_ids=TEXT, position_ids=positions).logits, text) <= TOLERANCE
    assert relative(folded(input_ids=TEXT, logits_to_keep=1).logits, text[:, -1:]) <= TOLERANCE
    assert relative(folded(input_ids=TEXT, logits_to_keep=4).logits, text[:, -4:]) <= TOLERANCE
    embeds = folded.get_input_embeddings()(TEXT)
    assert relative(folded(inputs_embeds=embeds).logits, text) <= TOLERANCE
    out = folded(input_ids=TEXT, return_dict=False)
    assert isinstance(out, tuple) and len(out) == 2  # (logits, cache), as transformers' own tuple
    assert relative(out[0], text) <= TOLERANCE
    out = folded(input_ids=TEXT, return_dict=False, use_cache=False)
    assert isinstance(out, tuple) and len(out) == 1 and relative(out[0], text) <= TOLERANCE


@torch.no_grad()
def test_a_cropped_or_reordered_cache_and_beam_search(pair):
    model, folded, expected = pair
    first = folded(input_ids=TEXT[:, :6], use_cache=True)
    first.cache.crop(-2)  # speculative decoding rejects the last two tokens
    rest = folded(input_ids=TEXT[:, 4:], cache=first.cache)
    assert relative(rest.logits, expected[:, 5:]) <= TOLERANCE
    first = folded(input_ids=TEXT[:, :6], use_cache=True)
    first.cache.reorder_cache(torch.tensor([1, 0]))  # what beam search does between steps
    rest = folded(input_ids=TEXT.flip(0)[:, 6:], past_key_values=first.cache)
    assert relative(rest.logits, expected.flip(0)[:, 7:]) <= TOLERANCE
    options = dict(max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2)
    assert torch.equal(folded.generate(TEXT, **options), model.generate(with_sink(TEXT), **options)[:, 1:])


@torch.no_grad()
def test_a_decode_step_with_past_key_values_costs_no_more_aten_ops_than_with_cache(pair):
    _, folded, _ = pair
    prefill = folded(input_ids=TEXT, use_cache=True).cache
    counts = {}
    for name in ("cache", "past_key_values"):
        cache = DynamicCache(config=folded.config)
        for index, layer in enumerate(prefill.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), index)
        step = lambda name=name, cache=cache: folded(input_ids=TEXT[:, -1:], use_cache=True, **{name: cache})
        counts[name] = count_aten_ops(step)
    assert counts["past_key_values"]["aten_ops"] <= counts["cache"]["aten_ops"], counts


# ------------------------------------------------------------------ the input starts with the sink (BOS)
@torch.no_grad()
def test_input_that_starts_with_the_sink_equals_the_tapered_model_on_the_same_input(pair):
    model, folded, expected = pair
    ids = with_sink(TEXT)
    out = folded(input_ids=ids, labels=ids)
    assert relative(out.logits, expected) <= TOLERANCE  # the sink's own logits included
    assert float(out.loss) == pytest.approx(float(model(input_ids=ids, labels=ids).loss), rel=1e-5)
    assert out.cache.get_seq_length() == ids.shape[1]  # the cache is as long as the input, as the tapered one
    rest = folded(input_ids=TEXT[:, :3], cache=out.cache)  # continues like the tapered model's cache
    reference = model(input_ids=TEXT[:, :3], cache=model(input_ids=ids, use_cache=True).cache).logits
    assert relative(rest.logits, reference) <= TOLERANCE
    assert relative(folded(input_ids=ids, logits_to_keep=1).logits, expected[:, -1:]) <= TOLERANCE
    assert relative(folded(input_ids=ids, logits_to_keep=ids.shape[1]).logits, expected) <= TOLERANCE
    options = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    generated, reference = folded.generate(ids, **options), model.generate(ids, **options)
    assert torch.equal(generated.sequences, reference.sequences)
    assert relative(torch.stack(generated.logits), torch.stack(reference.logits)) <= TOLERANCE
    with pytest.raises(ValueError, match="some rows of input_ids start with the sink"):
        folded(input_ids=torch.cat([ids[:1, :-1], TEXT[1:]]))


@torch.no_grad()
def test_left_padded_batch_that_starts_each_row_with_the_sink(pair):
    model, folded, _ = pair
    short, full = with_sink(TEXT[1:, 2:5]), with_sink(TEXT[:1, :5])
    padded = torch.cat([torch.cat([torch.zeros(1, 2, dtype=TEXT.dtype), short], dim=1), full])
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    out = folded(input_ids=padded, attention_mask=mask).logits
    assert relative(out[0, 2:], model(short).logits[0]) <= TOLERANCE
    assert relative(out[1], model(full).logits[0]) <= TOLERANCE
    options = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    batched = folded.generate(padded, attention_mask=mask, **options)
    assert torch.equal(batched[0, 2:], model.generate(short, **options)[0])


@torch.no_grad()
def test_model_on_tokenizer_output_equals_the_tapered_model_whether_or_not_the_tokenizer_adds_bos(pair):
    model, folded, _ = pair
    adds_bos, plain = word_tokenizer(adds_bos=True), word_tokenizer(adds_bos=False)
    text = "the quick brown fox jumps over a lazy dog"
    encoded = adds_bos(text, return_tensors="pt")
    assert encoded.input_ids[0, 0] == SINK
    assert relative(folded(**encoded).logits, model(**encoded).logits) <= TOLERANCE
    encoded = plain(text, return_tensors="pt")
    assert encoded.input_ids[0, 0] != SINK
    assert relative(folded(**encoded).logits, model(with_sink(encoded.input_ids)).logits[:, 1:]) <= TOLERANCE
    texts = ["a lazy dog jumps", "the quick fox"]  # left padding of one, within the tiny sliding window
    for tokenizer in (adds_bos, plain):
        tokenizer.padding_side = "left"
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        generated = folded.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for row, alone in enumerate(texts):
            ids = tokenizer(alone, return_tensors="pt").input_ids
            reference = model.generate(
                ids if tokenizer is adds_bos else with_sink(ids), max_new_tokens=2, do_sample=False
            )
            assert torch.equal(generated[row, -2:], reference[0, -2:]), (tokenizer is adds_bos, alone)


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_export_decodes_alike_with_either_cache_name_at_the_same_op_count_and_reads_its_tokenizer():
    """SmolLM2-135M cut to 4 layers (untrained at g = 0 the full model is not finite), BOS sink, every internal
    norm folded: a hand-written decoding loop with past_key_values= equals cache= and the tapered model, at no
    more aten ops per step; the tokenizer's output (no BOS) and BOS + text both equal the tapered model."""
    from tests.conftest import smollm2_sink_model

    model, tokenizer, tokens, bos = smollm2_sink_model()
    folded = fold_model(model, probe=tokens[None, 800:864])
    prompt = tokens[None, 900:940]
    expected = model(torch.cat([torch.tensor([[bos]]), prompt], dim=1)).logits
    steps = {}
    for name in ("cache", "past_key_values"):
        out = folded(input_ids=prompt[:, :30], use_cache=True)
        logits, cache = [out.logits], out.cache
        for index in range(30, prompt.shape[1]):
            out = folded(input_ids=prompt[:, index : index + 1], use_cache=True, **{name: cache})
            logits.append(out.logits)
            cache = out.cache
        assert relative(torch.cat(logits, dim=1), expected[:, 1:]) <= 1e-5, name
        step = lambda name=name, cache=cache: folded(input_ids=prompt[:, -1:], use_cache=True, **{name: cache})
        steps[name] = count_aten_ops(step)["aten_ops"]
    assert steps["past_key_values"] <= steps["cache"], steps
    encoded = tokenizer("def wrap(text, width=70):", return_tensors="pt")
    assert encoded.input_ids[0, 0] != bos  # SmolLM2's tokenizer adds no BOS
    reference = model(torch.cat([torch.tensor([[bos]]), encoded.input_ids], dim=1)).logits
    assert relative(folded(**encoded).logits, reference[:, 1:]) <= 1e-5
    with_bos = torch.cat([torch.tensor([[bos]]), encoded.input_ids], dim=1)
    assert relative(folded(input_ids=with_bos, attention_mask=torch.ones_like(with_bos)).logits, reference) <= 1e-5
    print(f"\nSmolLM2 4 layers: aten ops per decode step {steps}")
