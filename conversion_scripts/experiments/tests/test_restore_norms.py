"""restore_norms (conversion_scripts/experiments/restore_norms.py) on a tiny model: which norms it switches back."""

import copy

import pytest
import torch

from conversion_scripts.experiments.restore_norms import broken_of, layer_range, set_norms
from hf_tapernorm.layers import set_gate
from tests.conftest import random_batches
from tests.helpers import tapered as tapered_tiny_model

pytestmark = pytest.mark.experiments

MLP_NORMS = ["model.layers.*.post_attention_layernorm"]


def test_layer_ranges_read_as_the_docstring_says():
    assert layer_range("0-3") == [0, 1, 2, 3] and layer_range("2") == [2] and layer_range("14-15") == [14, 15]


def test_restoring_every_tapered_attention_norm_gives_the_normalized_model_back():
    model = tapered_tiny_model("llama", keep_norms=MLP_NORMS)
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        tapered = model(ids).logits
        normalized = copy.deepcopy(model)
        set_gate(normalized, 1.0)  # every tapered norm computes its norm again
        expected = normalized(ids).logits
        assert set_norms(model, [0], 1.0) == 1  # one layer's attention input norm, nothing else
        one = model(ids).logits
        assert set_norms(model, [1], 1.0) == 1
        torch.testing.assert_close(model(ids).logits, expected)
        assert not torch.allclose(one, expected) and not torch.allclose(tapered, expected)
        assert set_norms(model, [0, 1], 0.0) == 2
        torch.testing.assert_close(model(ids).logits, tapered)  # back at the run's gate
    assert set_norms(model, [5], 1.0) == 0  # no such layer: the script refuses the group


def test_broken_blocks_are_read_from_both_sets_of_the_report():
    report = {
        "heldout_documents": {"broken_blocks": {"blocks": [3]}},
        "out_of_corpus_blocks": {"broken_blocks": {"threshold_nats": 2.0, "blocks": [207, 9]}},
    }
    assert broken_of(report) == {"held-out": [3], "out-of-corpus": [207, 9]}
    assert broken_of({}) == {"held-out": [], "out-of-corpus": []}
