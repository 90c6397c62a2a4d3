"""Export and loading cases a user can hand a folded export (issue 34): each gives the right result or one clear
early error. Tiny models; the reference of a sink export is the unfolded model at g = 0 on ``[sink] + text``."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.export.hub import export_manifest
from tests.test_export_state import TEXT, relative, sink_tapered, with_sink
from tests.test_sink_contract import word_tokenizer


def test_export_folded_writes_the_tokenizer_into_the_manifest_and_says_how_a_leading_sink_is_read(tmp_path, caplog):
    model = sink_tapered("llama")
    folded = fold_model(model)
    tokenizer = word_tokenizer(adds_bos=True)
    with caplog.at_level(logging.INFO, logger="hf_tapernorm.export.hub"):
        folder = export_folded(folded, tmp_path / "out", tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(export_manifest(folder))
    messages = [r for r in caplog.records if "adds the sink token(s)" in r.getMessage()]
    assert [r.levelno for r in messages] == [logging.INFO]
    assert "the same logits" in messages[0].getMessage()
    # What the message says holds: with and without the tokenizer's BOS, the text's logits agree.
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "the quick brown fox jumps over a lazy dog"
    with torch.no_grad():
        with_bos = reloaded(**loaded_tokenizer(text, return_tensors="pt")).logits
        without = reloaded(**loaded_tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits
    assert relative(without, with_bos[:, 1:]) <= 1e-6


def test_export_folded_refuses_a_tokenizer_that_is_not_one(tmp_path):
    from hf_tapernorm import ConfigurationError

    folded = fold_model(sink_tapered("llama"))
    with pytest.raises(ConfigurationError, match="tokenizer= must be a transformers tokenizer"):
        export_folded(folded, tmp_path / "out", tokenizer="gpt2")
    assert not (tmp_path / "out").exists()


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


def test_the_export_restores_use_cache_that_a_trainer_turned_off(tmp_path):
    model = sink_tapered("llama")
    model.config.use_cache = False  # what Trainer leaves on a model it trained with gradient checkpointing
    folder = export_folded(fold_model(model), tmp_path / "out")
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded(input_ids=TEXT).cache is not None


def test_an_export_whose_config_lost_layers_is_refused_naming_folder_and_field(tmp_path):
    folder = export_folded(fold_model(sink_tapered("llama")), tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        OSError, match=r"out: .*config.json's folded_norms names model\.layers\.1\..*num_hidden_layers=1"
    ):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_gpt2_eos_sink_export_records_its_positions_and_refuses_past_them_in_one_line():
    from tests.test_sink import sink_tapered as gpt2_sink_tapered

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


def test_fine_tuning_a_sink_export_with_gradient_checkpointing_matches_without(tmp_path):
    folded = fold_model(sink_tapered("llama"))
    folded.train()
    labels = with_sink(TEXT)
    plain = folded(input_ids=labels, labels=labels)
    plain.loss.backward()
    grads = {n: p.grad.clone() for n, p in folded.named_parameters() if p.grad is not None}
    folded.zero_grad()
    folded.gradient_checkpointing_enable()
    checkpointed = folded(input_ids=labels, labels=labels)
    checkpointed.loss.backward()
    assert torch.allclose(checkpointed.loss, plain.loss, atol=1e-6)
    assert all(torch.allclose(p.grad, grads[n], atol=1e-6) for n, p in folded.named_parameters() if n in grads)
    with pytest.raises(ValueError, match="a cache cannot be passed while training with gradient checkpointing"):
        folded(input_ids=labels, cache=DynamicCache(config=folded.config))


def test_a_tapered_folder_cannot_be_loaded_as_a_plain_model_and_load_tapered_reads_it(tmp_path):
    from hf_tapernorm import load_tapered, save_tapered
    from hf_tapernorm.evaluation.models import read_model_config, resolve_model
    from tests.conftest import char_tokenizer

    model = sink_tapered("llama")
    folder = save_tapered(model, tmp_path / "tapered", char_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "hf_tapernorm_tapered_llama" and "load_tapered" in config["hf_tapernorm_note"]
    with pytest.raises(ValueError, match="hf_tapernorm_tapered_llama"):  # not silently a LlamaForCausalLM
        AutoModelForCausalLM.from_pretrained(folder)
    reloaded = load_tapered(folder)
    assert type(reloaded).__name__ == "LlamaForCausalLM" and reloaded.config.model_type == "llama"
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=with_sink(TEXT)).logits, model(input_ids=with_sink(TEXT)).logits)
    source = resolve_model(str(folder))
    assert source.kind == "tapered" and read_model_config(source).num_hidden_layers == model.config.num_hidden_layers
    assert AutoTokenizer.from_pretrained(folder)("ab")["input_ids"] == [97, 98]


@pytest.mark.parametrize("how", ["save_pretrained", "deepcopy", "pickle"])
def test_a_patched_models_own_save_pretrained_writes_a_tapered_checkpoint(tmp_path, how):
    """A plain ``model.save_pretrained`` of a patched model (not only save_tapered) is refused by AutoModel and read
    exactly by load_tapered; a deep copy (the distillation teacher is one) and a whole-module ``torch.save`` round
    trip save themselves, not the original."""
    import copy
    import io

    from hf_tapernorm import load_tapered

    original = sink_tapered("llama")
    model = original
    if how == "deepcopy":
        model = copy.deepcopy(original)
    elif how == "pickle":
        buffer = io.BytesIO()
        torch.save(original, buffer)
        model = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # our own object, in this test
    if how != "save_pretrained":
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)  # the copy computes another function than the original
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "hf_tapernorm_tapered_llama" and "load_tapered" in config["hf_tapernorm_note"]
    assert (tmp_path / "saved" / "tapernorm_config.json").is_file()
    with pytest.raises(ValueError, match="hf_tapernorm_tapered_llama"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    reloaded = load_tapered(tmp_path / "saved")
    with torch.no_grad():
        expected = model(input_ids=with_sink(TEXT)).logits
        assert torch.equal(reloaded(input_ids=with_sink(TEXT)).logits, expected)
        if how != "save_pretrained":
            assert not torch.allclose(expected, original(input_ids=with_sink(TEXT)).logits)
    model.save_pretrained(tmp_path / "saved")  # saved twice into one folder: marked once
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "hf_tapernorm_tapered_llama"
