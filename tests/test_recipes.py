"""Recipe presets: selection by size, and what apply_recipe configures."""

import pytest
import torch

from hf_tapernorm import patch_model, tapered_norms
from hf_tapernorm.recipes import PAPER, PRESETS, TaperRecipe, apply_recipe, recipe_for
from hf_tapernorm.regularizers import TokenScalePenalty

from .conftest import random_batches


def test_recipe_for_picks_the_preset_by_parameter_count(tiny_llama):
    assert recipe_for(135_000_000) is PRESETS["small"][1]
    assert recipe_for(1_200_000_000) is PRESETS["medium"][1]
    assert recipe_for(8_000_000_000) is PRESETS["large"][1]
    assert recipe_for(tiny_llama) is PRESETS["small"][1]
    assert PAPER.sink_tokens == 0 and PAPER.calibration_trim is None and not PAPER.per_channel


def test_apply_recipe_sets_sinks_fits_and_returns_the_penalty(tiny_llama):
    batch = random_batches(n=1)[0]
    before = tiny_llama(batch).logits
    model = patch_model(tiny_llama)
    recipe = TaperRecipe("t", 0.05, 0.9, 1e-4, sink_tokens=2, calibration_trim=4.0, per_channel=True, scale_penalty=0.1)
    with pytest.raises(ValueError, match="keeps 2 sink token.s.: pass sink_token_ids"):
        apply_recipe(model, recipe, [batch])
    penalty = apply_recipe(model, recipe, [batch], sink_token_ids=[3, 4])
    assert isinstance(penalty, TokenScalePenalty) and penalty.sink_tokens == 2
    assert model.config.tapernorm_sink_token_ids == [3, 4]
    layers = [layer for _, layer in tapered_norms(model)]
    assert all(layer.sink_tokens == 2 and layer.is_calibrated for layer in layers)
    assert torch.equal(model(batch).logits, before)  # still gate 1: nothing changed
    assert apply_recipe(model, TaperRecipe("off", 0.05, 0.9, 1e-4, sink_tokens=0)) is None
    assert not hasattr(model.config, "tapernorm_sink_token_ids")
    assert apply_recipe(model, TaperRecipe("bos", 0.05, 0.9, 1e-4)) is None  # one-token sink: the config's BOS
    assert model.config.tapernorm_sink_token_ids == [model.config.bos_token_id]


def test_apply_recipe_refuses_an_unpatched_model(tiny_llama):
    with pytest.raises(ValueError, match="has no tapered TaperNorm layers; call patch_model"):
        apply_recipe(tiny_llama, PAPER)
