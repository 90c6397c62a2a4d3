"""Export and loading cases a user can hand a folded export (issue 34): each gives the right result or one clear
early error. Tiny models; the reference of a sink export is the unfolded model at g = 0 on ``[sink] + text``."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.export.hub import export_manifest
from tests.test_export_state import relative, sink_tapered
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
    import pytest

    from hf_tapernorm import ConfigurationError

    folded = fold_model(sink_tapered("llama"))
    with pytest.raises(ConfigurationError, match="tokenizer= must be a transformers tokenizer"):
        export_folded(folded, tmp_path / "out", tokenizer="gpt2")
    assert not (tmp_path / "out").exists()
