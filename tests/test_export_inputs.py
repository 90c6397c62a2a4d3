"""An export's input contract: a leading sink, left padding, 2D and 4D masks and positions read as the tapered model
reads them, and an export from an earlier hf_tapernorm (a sink without stored logits) still evaluates.

The reference is the tapered model at g = 0 on ``sink + text``, each row alone (no padding): the export holds the
sink itself, so it reads the text alone or after the sink, padded or not, to the same logits.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tapernorm import export_folded, fold_model
from tests.conftest import char_tokenizer, random_batches
from tests.helpers import run_main, tapered

EOS = 127  # the character tokenizer's <eos>: GPT-2's sink is its EOS
TOLERANCE = 1e-4


@functools.cache
def tapered_and_folded(kind: str, sink: int = EOS):
    """A tiny tapered model with a one-token sink at g = 0, and its fold (built once per kind)."""
    model = tapered(kind, sink_token_ids=[sink]).eval()
    return model, fold_model(model)


def left_padding_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = "<unk>", "left"
    return tokenizer


def alone(model, ids: list[int]) -> torch.Tensor:
    """The tapered model's logits of one unpadded row that starts with the sink."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


# ----------------------------------------------------------------------------- left padding
@pytest.mark.parametrize("sink_first", [False, True], ids=["text", "sink-first"])
def test_a_left_padded_batch_on_a_gpt2_sink_export_reads_each_row_as_the_tapered_model_does(sink_first):
    """``model(**tokenizer(texts, padding=True))`` with left padding: GPT-2's learned positions never see a pad's
    negative position, and every row's text (and sink) has the logits the tapered model gives it alone."""
    model, folded = tapered_and_folded("gpt2")
    tokenizer = left_padding_tokenizer()
    texts = ["hello world", "hi", "a longer line of text"]
    batch = tokenizer([("<eos>" if sink_first else "") + text for text in texts], padding=True, return_tensors="pt")
    assert batch.attention_mask[:, 0].eq(0).any()  # left padded
    with torch.no_grad():
        logits = folded(**batch).logits
    for row, text in enumerate(texts):
        expected = alone(model, [EOS, *tokenizer(text).input_ids])
        got = logits[row, batch.attention_mask[row].bool()]
        assert (got - (expected if sink_first else expected[1:])).abs().max().item() <= TOLERANCE


def test_a_left_padded_batch_generates_on_a_gpt2_sink_export_as_each_row_alone():
    _, folded = tapered_and_folded("gpt2")
    tokenizer = left_padding_tokenizer()
    texts = ["hello world", "hi"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        together = folded.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for row, text in enumerate(texts):
            single = folded.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=6, do_sample=False)
            assert torch.equal(together[row, -6:], single[0, -6:])


# ----------------------------------------------------------------------------- 4D masks
def custom_mask(length: int, *, additive: bool) -> torch.Tensor:
    """A 4D mask over ``sink + text`` that is not plain causal (later tokens skip some text), boolean or additive."""
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)).expand(2, 1, length, length).clone()
    allowed[:, :, 6:, 1:4] = False
    allowed[1, :, 8:, 4:6] = False
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("sink_first", [False, True], ids=["text", "sink-first"])
def test_a_4d_mask_on_a_sink_export_gives_the_tapered_models_logits(kind, additive, sink_first):
    """The caller's 4D mask covers what the caller passes: ``sink + text`` (the sink's query rows go, its key columns
    lead) or the text alone (the sink's columns are put in front, attended by every query)."""
    model, folded = tapered_and_folded(kind, sink=5)
    text = random_batches(vocab=120, n=1, batch=2, length=10, seed=3)[0] + 6
    ids = torch.cat([torch.full((2, 1), 5), text], dim=1)
    mask = custom_mask(ids.shape[1], additive=additive)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        assert (expected - model(input_ids=ids).logits).abs().max().item() > 1e-2  # the mask matters
        if sink_first:
            logits = folded(input_ids=ids, attention_mask=mask).logits
        else:
            logits, expected = folded(input_ids=text, attention_mask=mask[:, :, 1:, 1:]).logits, expected[:, 1:]
    assert (logits - expected).abs().max().item() <= TOLERANCE


# ----------------------------------------------------------------------------- an export from an earlier version
@pytest.fixture(scope="module")
def exports_with_and_without_sink_logits(tmp_path_factory):
    """A Llama sink export, and the same export as an earlier hf_tapernorm wrote it: no stored sink logits, hidden
    states or attention rows."""
    root = tmp_path_factory.mktemp("earlier")
    _, folded = tapered_and_folded("llama")
    current = export_folded(folded, root / "current", tokenizer=char_tokenizer())
    earlier = export_folded(folded, root / "earlier", tokenizer=char_tokenizer())
    weights = load_file(earlier / "model.safetensors")
    config = json.loads((earlier / "config.json").read_text())
    for name in ("logits", "hidden_states", "attentions"):
        del weights[f"sink_{name}"], config[f"sink_{name}_shape"]
    save_file(weights, earlier / "model.safetensors", metadata={"format": "pt"})
    (earlier / "config.json").write_text(json.dumps(config, indent=2))
    return current, earlier


def test_an_earlier_export_reads_a_sink_first_input_with_the_texts_exact_logits(exports_with_and_without_sink_logits):
    current, earlier = exports_with_and_without_sink_logits
    text = random_batches(vocab=120, n=1, batch=2, length=10, seed=3)[0] + 6
    ids = torch.cat([torch.full((2, 1), EOS), text], dim=1)
    old = AutoModelForCausalLM.from_pretrained(earlier).eval()
    new = AutoModelForCausalLM.from_pretrained(current).eval()
    assert not hasattr(old, "sink_logits")
    with torch.no_grad(), pytest.warns(UserWarning, match="stores its sink's keys/values but not its logits"):
        logits, reference = old(input_ids=ids).logits, new(input_ids=ids).logits
        # The sink's logits are not stored: NaN says so; the text's are the export's.
        assert torch.isnan(logits[:, 0]).all() and torch.equal(logits[:, 1:], reference[:, 1:])
        assert torch.equal(old.generate(ids, max_new_tokens=4, do_sample=False), new.generate(ids, max_new_tokens=4))
        with pytest.raises(ValueError, match=r"whose logits this export \(from an earlier hf_tapernorm\) does not"):
            old(input_ids=ids, labels=ids)


def test_eval_of_an_earlier_export_gives_the_current_exports_loss(exports_with_and_without_sink_logits, workspace):
    current, earlier = exports_with_and_without_sink_logits
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "4",
            "--heldout_percentage", "10", "--data_cache_dir", str(workspace / "datasets_cache"),
            "--out_of_corpus_blocks", "16", "--scan_windows", "0", "--sink", "auto"]  # fmt: skip
    results = {}
    for folder in (current, earlier):
        code, stdout, stderr = run_main(["eval", "--model_name_or_path", str(folder), *data])
        assert code == 0, stderr
        results[folder.name] = json.loads(stdout.strip().splitlines()[-1])
    assert results["earlier"]["sink_token_ids"] == [EOS]
    assert results["earlier"]["loss"] == pytest.approx(results["current"]["loss"], rel=1e-6)
    assert results["earlier"]["out_of_corpus"]["loss"] == pytest.approx(results["current"]["out_of_corpus"]["loss"])


# ----------------------------------------------------------------------------- hidden states and attentions
def eager_outputs(model, **inputs):
    """``model``'s outputs with hidden states and attention weights, in eager attention (restored after)."""
    previous = model.config._attn_implementation  # transformers exposes the setter only
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**inputs, output_hidden_states=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_sink_first_input_gives_hidden_states_and_attentions_at_every_column_of_the_input(kind, tmp_path):
    """The sink's hidden states and attention rows are constants stored at fold time and put back in its columns:
    every output has one column per input id, and equals the tapered model's at g = 0. The last hidden state's text
    columns are the export's own (the final norm's map went into its head), those of the text without the sink."""
    model, folded = tapered_and_folded(kind)
    export = AutoModelForCausalLM.from_pretrained(export_folded(folded, tmp_path / "export"))
    assert (
        model.config._attn_implementation == "sdpa"
    )  # folding read the sink's attentions and left the model as it was
    text = torch.tensor([[104, 101, 108, 108, 111], [119, 111, 114, 108, 100]])
    ids = torch.cat([torch.full((2, 1), EOS), text], dim=1)
    expected, got = eager_outputs(model, input_ids=ids), eager_outputs(export, input_ids=ids)
    alone = eager_outputs(export, input_ids=text)
    assert got.logits.shape[:2] == ids.shape and len(got.hidden_states) == len(expected.hidden_states)
    for index, (hidden, reference) in enumerate(zip(got.hidden_states, expected.hidden_states)):
        assert hidden.shape == reference.shape
        assert (hidden[:, 0] - reference[:, 0]).abs().max().item() <= TOLERANCE  # the sink's column
        last = index == len(got.hidden_states) - 1
        texts = alone.hidden_states[index] if last else reference[:, 1:]
        assert (hidden[:, 1:] - texts).abs().max().item() <= TOLERANCE
    for weights, reference in zip(got.attentions, expected.attentions, strict=True):
        assert weights.shape == reference.shape == (2, reference.shape[1], 6, 6)
        assert (weights - reference).abs().max().item() <= TOLERANCE


def test_a_left_padded_sink_first_batch_gives_each_rows_hidden_states_and_attentions():
    """With left padding each row's sink sits after its pads: its stored rows go there, attention keys come back in
    the caller's column order (the cache holds the sink first), also for the call that continues the cache."""
    model, folded = tapered_and_folded("gpt2")
    tokenizer = left_padding_tokenizer()
    texts = ["hello world", "hi", "a longer line of text"]
    batch = tokenizer(["<eos>" + text for text in texts], padding=True, return_tensors="pt")
    got = eager_outputs(folded, **batch, use_cache=True)
    mask = torch.cat([batch.attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    following = eager_outputs(folded, input_ids=torch.full((3, 1), 104), attention_mask=mask, cache=got.cache)
    for row, text in enumerate(texts):
        expected = eager_outputs(model, input_ids=torch.tensor([[EOS, *tokenizer(text).input_ids, 104]]))
        kept, seen = batch.attention_mask[row].bool(), mask[row].bool()
        for hidden, reference in zip(got.hidden_states, expected.hidden_states, strict=True):
            assert (hidden[row, kept] - reference[0, :-1]).abs().max().item() <= TOLERANCE
        for weights, reference in zip(got.attentions, expected.attentions, strict=True):
            assert (weights[row][:, kept][:, :, kept] - reference[0, :, :-1, :-1]).abs().max().item() <= TOLERANCE
        for weights, reference in zip(following.attentions, expected.attentions, strict=True):
            assert (weights[row, :, -1, seen] - reference[0, :, -1]).abs().max().item() <= TOLERANCE


def test_an_earlier_export_gives_nan_sink_columns_in_hidden_states_and_attentions_with_one_warning(
    exports_with_and_without_sink_logits,
):
    current, earlier = exports_with_and_without_sink_logits
    ids = torch.cat([torch.full((2, 1), EOS), random_batches(vocab=120, n=1, batch=2, length=10, seed=3)[0] + 6], 1)
    old = AutoModelForCausalLM.from_pretrained(earlier).eval()
    new = AutoModelForCausalLM.from_pretrained(current).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = eager_outputs(old, input_ids=ids)
    said = [str(w.message) for w in caught if "stores its sink's keys/values" in str(w.message)]
    assert len(said) == 1 and "not its logits, hidden states and attentions: " in said[0], said
    reference = eager_outputs(new, input_ids=ids)
    for mine, theirs in [*zip(got.hidden_states, reference.hidden_states), *zip(got.attentions, reference.attentions)]:
        assert mine.shape == theirs.shape
    for hidden, expected in zip(got.hidden_states, reference.hidden_states, strict=True):
        assert torch.isnan(hidden[:, 0]).all() and torch.equal(hidden[:, 1:], expected[:, 1:])
    for weights, expected in zip(got.attentions, reference.attentions, strict=True):
        assert torch.isnan(weights[:, :, 0]).all() and torch.equal(weights[:, :, 1:], expected[:, :, 1:])


def test_one_dimensional_ids_are_refused_in_one_line_naming_the_shape():
    _, folded = tapered_and_folded("llama")
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \[3\]; pass one sequence as a"):
        folded(input_ids=torch.tensor([104, 101, 108]))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_input_of_the_sink_alone_is_refused_in_one_line(kind):
    """The model runs on the text after its sink: the sink alone (a tokenizer's BOS for empty text) was a reshape
    error from inside attention."""
    _, folded = tapered_and_folded(kind)
    with pytest.raises(ValueError, match=r"the input is only the stored sink \[127\]: its logits are stored"):
        folded(input_ids=torch.tensor([[EOS]]))


# ----------------------------------------------------------------------------- other per-token inputs
def test_token_type_ids_on_a_gpt2_sink_export_are_refused_in_one_line():
    """GPT-2 adds its token types through the token embedding, the sink's too: the tapered model's sink changes with
    them, the export's stored sink cannot, so a call with them is refused (it was a reshape error with the sink in
    the ids, and a silently different sink without)."""
    _, folded = tapered_and_folded("gpt2")
    text = random_batches(vocab=120, n=1, batch=2, length=10, seed=4)[0] + 3  # never the sink
    ids = torch.cat([torch.full((2, 1), EOS), text], dim=1)
    for call in (ids, text):
        with pytest.raises(ValueError, match=r"token_type_ids would change the embedding of the sink \[127\]"):
            folded(input_ids=call, token_type_ids=torch.zeros_like(call))
    with torch.no_grad():
        assert folded(input_ids=ids, token_type_ids=None).logits.shape == (2, 11, folded.config.vocab_size)


# ----------------------------------------------------------------------------- given positions
def sink_position_refusal(position: int) -> str:
    return (
        f"TaperNormGPT2LMHeadModel: position_ids put the stored sink [127] at position {position} in row 0; this "
        "export stores its states at position 0: count positions from the sink (0), or pass no position_ids"
    )


def test_position_ids_that_put_the_stored_sink_elsewhere_than_0_are_refused_in_one_line():
    """Given position_ids on a sink-first input were re-based on the sink's column: 50..70 and 110..130 (past the
    64-row table) ran silently with the logits of 0..20, the caller's offset dropped. The stored sink's states are
    computed at 0, so those calls are refused now; positions that give the sink 0 (from 0, or as generate() counts a
    left-padded mask, the sink at a different column in each row) keep the default's logits and generations."""
    model, folded = tapered_and_folded("gpt2")
    text = random_batches(vocab=120, n=1, batch=1, length=20, seed=5)[0] + 3  # never the sink
    ids = torch.cat([torch.full((1, 1), EOS), text], dim=1)
    with torch.no_grad():
        for offset in (50, 110):
            with pytest.raises(ValueError) as error:
                folded(input_ids=ids, position_ids=torch.arange(21)[None] + offset)
            assert str(error.value) == sink_position_refusal(offset)
        assert torch.equal(folded(input_ids=ids, position_ids=torch.arange(21)[None]).logits, folded(ids).logits)
        tokenizer = left_padding_tokenizer()
        texts = ["hello world", "hi", "a longer line of text"]
        batch = tokenizer(["<eos>" + text for text in texts], padding=True, return_tensors="pt")
        mask = batch.attention_mask
        assert mask[:, 0].eq(0).any() and mask[:, 0].any()  # the sink at a different column in each row
        default = folded(**batch).logits
        for pads in (1, -1):  # generate()'s positions (pads at 1), and the plain cumsum (pads at -1)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, pads)
            given = folded(**batch, position_ids=positions).logits
            assert torch.equal(given[mask.bool()], default[mask.bool()])
        generated = folded.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for row, text in enumerate(texts):
            single = model.generate(
                torch.tensor([[EOS, *tokenizer(text).input_ids]]), max_new_tokens=4, do_sample=False
            )
            assert torch.equal(generated[row, -4:], single[0, -4:])


def test_one_dimensional_position_ids_on_a_sink_first_input_are_one_row_for_every_row():
    """1D position_ids (as GPT-2 takes them) on a sink-first input kept the sink's column: a RuntimeError of sizes
    deep in the model, and a 1D offset one shorter than the input ran without a word at positions 50..69. A 1D row
    is read as [1, L], as 2D positions are (from 0: the default's logits; an offset: refused), and a length that is
    not the input's is refused in one line."""
    _, folded = tapered_and_folded("gpt2")
    text = random_batches(vocab=120, n=1, batch=1, length=20, seed=5)[0] + 3
    ids = torch.cat([torch.full((1, 1), EOS), text], dim=1)
    with torch.no_grad():
        assert torch.equal(folded(input_ids=ids, position_ids=torch.arange(21)).logits, folded(ids).logits)
        with pytest.raises(ValueError) as error:
            folded(input_ids=ids, position_ids=torch.arange(21) + 50)
        assert str(error.value) == sink_position_refusal(50)
        with pytest.raises(ValueError) as error:
            folded(input_ids=ids, position_ids=torch.arange(20) + 50)
    assert str(error.value) == (
        "TaperNormGPT2LMHeadModel: position_ids hold 20 positions for 21 input columns; give one position per "
        "column, or pass no position_ids"
    )


_SINK_POSITIONS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
text = torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(0))
ids = torch.cat([torch.tensor([[127]]), text], 1)
with torch.no_grad():
    for offset in (50, 110):
        try:
            model(ids, position_ids=torch.arange(21)[None] + offset)
            print(offset, "ran")
        except ValueError as error:
            print(offset, error)
    print("from 0", torch.equal(model(ids, position_ids=torch.arange(21)[None]).logits, model(ids).logits))
print(type(model).__module__, "hf_tapernorm" in sys.modules)
"""


def test_the_exports_own_copy_refuses_position_ids_that_move_the_stored_sink(tmp_path):
    """The export ships its own folded_input.py: its copy re-based given position_ids on the sink's column, so a
    call at 50.. or 110.. ran with the logits of 0..; it refuses them in one line now, under ``python -I``."""
    _, folded = tapered_and_folded("gpt2")
    folder = export_folded(folded, tmp_path / "out", tokenizer=char_tokenizer())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", _SINK_POSITIONS, str(folder)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    expected = [f"{offset} {sink_position_refusal(offset)}" for offset in (50, 110)] + ["from 0 True"]
    assert lines[:-1] == expected, done.stdout + done.stderr[-2000:]
    assert lines[-1].startswith("transformers_modules.") and lines[-1].endswith(" False")  # the export's own code
