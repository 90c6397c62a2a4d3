"""Every way transformers 5 lets a caller pass state reaches a folded sink export and gives the unfolded answer.

The reference is the unfolded model at g = 0 on ``[sink] + text``; every comparison is a maximum relative
difference of logits (fp32). Tiny models of every gated family in the architecture table, whose recipe keeps
the BOS sink (docs/usage.md has the table of these ways).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from hf_tapernorm import fold_model
from hf_tapernorm.app.showcase import count_aten_ops
from hf_tapernorm.architectures.table import ARCHITECTURES, architecture_for
from tests.conftest import FAMILY_CASES, tiny_family_config
from tests.helpers import SINK, TEXT, relative, sink_tapered, tapered, with_sink, word_tokenizer

GATED = [
    case
    for case, (model_type, _) in FAMILY_CASES.items()
    if case == model_type
    and model_type in ARCHITECTURES
    and architecture_for(model_type, tiny_family_config(case)).gated_mlp
]
TOLERANCE = 1e-5
# gemma3_text's fp32 fold alone rounds to 2.2e-5 on TEXT (4e-7 in float64): the same with every way of passing state.
FOLD_ROUNDING = {"gemma3_text": 4e-5}


def test_every_gated_family_is_covered():
    assert set(GATED) == {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"}


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
def test_generate_from_inputs_embeds_with_or_without_the_sinks_embeddings(pair):
    """generate(inputs_embeds=...) was refused by transformers ("doesn't have its forwarding implemented"): the
    export's prepare_inputs_for_generation did not name inputs_embeds. It generates as the tapered model does."""
    model, folded, _ = pair
    options = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_logits=True)
    reference = model.generate(with_sink(TEXT), **options)
    for ids in (with_sink(TEXT), TEXT):
        out = folded.generate(inputs_embeds=folded.get_input_embeddings()(ids), **options)
        assert torch.equal(out.sequences[:, -2:], reference.sequences[:, -2:])
        assert relative(torch.stack(out.logits), torch.stack(reference.logits)) <= TOLERANCE


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
    # inputs_embeds that start with the sink's embedding, as the tapered model takes them, were read as text after
    # the stored sink (the sink counted twice, logits off with no word): they are read as input_ids with the sink are
    with_sink_embeds = folded.get_input_embeddings()(with_sink(TEXT))
    assert relative(folded(inputs_embeds=with_sink_embeds).logits, expected) <= TOLERANCE
    mixed = torch.cat([with_sink_embeds[:1, :-1], embeds[1:]])  # one row with the sink, one without
    with pytest.raises(ValueError, match=r"some rows of inputs_embeds start with the sink token\(s\)"):
        folded(inputs_embeds=mixed)
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


# ============================================================================= called again, by threads, resized
def test_generate_again_with_the_returned_cache_matches_a_fresh_generate_and_the_base_model():
    """Multi-turn reuse: the cache a first generate() returned continues without skipping its last token."""
    model = sink_tapered("llama")
    folded = fold_model(model)
    options = dict(max_new_tokens=3, do_sample=False)
    for name, m, prompt in (("tapered", model, with_sink(TEXT[:1])), ("folded", folded, TEXT[:1])):
        first = m.generate(prompt, return_dict_in_generate=True, **options)
        turn = torch.cat([first.sequences, torch.tensor([[5, 6]])], dim=1)
        again = m.generate(turn, cache=first.past_key_values, **options)
        assert torch.equal(again, m.generate(turn, **options)), name
    assert torch.equal(again[0, -3:], model.generate(with_sink(turn), **options)[0, -3:])


def test_two_threads_calling_one_sink_export_get_their_own_shapes():
    folded = fold_model(sink_tapered("llama"))
    inputs = [TEXT[:1, :5], with_sink(TEXT), TEXT, with_sink(TEXT[:1, :7])]
    with torch.no_grad():
        expected = [folded(input_ids=ids).logits for ids in inputs]
    failures = []

    def worker(index: int) -> None:
        for _ in range(10):
            with torch.no_grad():
                got = folded(input_ids=inputs[index]).logits
            if got.shape != expected[index].shape or not torch.allclose(got, expected[index], atol=1e-6):
                failures.append((index, tuple(got.shape)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert not [name for name in vars(folded) if name.startswith("_sink")]  # no per-call state on the module


def test_a_sink_first_input_works_after_resize_token_embeddings():
    model = sink_tapered("llama")
    folded = fold_model(model)
    with torch.no_grad():
        before = folded(input_ids=with_sink(TEXT)).logits
    folded.resize_token_embeddings(140)
    with torch.no_grad():
        after = folded(input_ids=with_sink(TEXT)).logits
        head = folded.get_output_embeddings().weight
        assert after.shape[-1] == 140
        assert relative(after[..., :128], before) <= 1e-5  # the old vocabulary's logits, the sink's included
        # A new token's logit at the sink is the new head row read from the sink's (recovered) final state.
        hidden = torch.linalg.lstsq(head[:128].double(), before[0, :1].double().T).solution
        assert torch.allclose(after[0, 0, 128:].double(), (head[128:].double() @ hidden)[:, 0], atol=1e-4)


def test_a_gpt2_eos_sink_export_records_its_positions_and_refuses_past_them_in_one_line():
    def gpt2_sink_tapered(kind):  # test_sink.py's sink_tapered: the sink [5], kept normalized
        return tapered(kind, "internal", sink_token_ids=[5])

    model = gpt2_sink_tapered("gpt2")
    folded = fold_model(model)
    limit = model.config.n_positions
    assert folded.config.sink_max_positions == limit
    n = len(folded.config.sink_token_ids)
    text = torch.randint(3, 100, (1, limit - n))
    with torch.no_grad():
        expected = model(input_ids=torch.cat([torch.tensor([folded.config.sink_token_ids]), text], 1)).logits[:, n:]
        assert relative(folded(input_ids=text).logits, expected) <= 1e-4  # the full context, less the sink
        with pytest.raises(ValueError, match=rf"the stored sink takes position\(s\) 0..{n - 1} .* {limit} tokens"):
            folded(input_ids=torch.randint(3, 100, (1, limit)))
    assert fold_model(sink_tapered("llama")).config.sink_max_positions == 0  # rotary: no table


def test_a_gpt2_sink_export_counts_the_positions_a_call_uses_against_its_table():
    """A sink export counted the cache (sink included) and the padded input against its 64 learned positions, as the
    sinkless one did: a left-padded generate that fits (63 positions of text after the sink) and a 66-column
    left-padded forward, with or without position_ids, were refused, and position_ids 55..64 on 10 tokens (65 after
    the sink) failed with IndexError. Now it counts the positions it computes at, the sink's shift included."""
    folded = fold_model(tapered("gpt2", "internal", sink_token_ids=[5])).eval()
    said = (
        "TaperNormGPT2LMHeadModel: the stored sink takes position(s) 0..0 of this model's 64 learned positions, so "
        "the sink and the text together hold at most 64 tokens (63 of text; sink_max_positions in config.json); "
        "this call reaches {}: shorten the input or crop the cache"
    )
    ids = torch.randint(6, 100, (2, 66), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    with torch.no_grad():
        padded = folded.generate(ids[:, :61], attention_mask=mask[:, :61], max_new_tokens=8, do_sample=False)
        alone = folded.generate(ids[:, 5:61], max_new_tokens=8, do_sample=False)
        assert torch.equal(padded[:, 61:], alone[:, 56:])  # text at positions 1..63, as without its pads
        with pytest.raises(ValueError) as error:
            folded.generate(ids[:, :61], attention_mask=mask[:, :61], max_new_tokens=9, do_sample=False)
        assert str(error.value) == said.format(65)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        given = folded(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        counted = folded(input_ids=ids, attention_mask=mask).logits  # per row from its first token, as given
        assert relative(counted[:, 5:], given[:, 5:]) <= 1e-5
        with pytest.raises(ValueError) as error:
            folded(input_ids=ids[:, :10], position_ids=torch.arange(55, 65)[None])
        assert str(error.value) == said.format(66)
