"""Recipe presets for tapering a pretrained model during continued pretraining, by model size.

A recipe bundles every choice the fidelity experiments (conversion_scripts/experiments/) showed to
matter on real pretrained models: the taper window, the learning rate, a normalized attention-sink
position, the calibration fit, and the token-scale penalty. ``recipe_for(model)`` picks the preset;
``apply_recipe(model, recipe, batches)`` configures a patched model and returns the penalty to add
to the training loss (or None). Which norms taper is decided when patching: for SwiGLU/GeGLU models
patch with ``keep_norms=norms_feeding_gated_mlps(model)`` (what ``hf-tapernorm taper`` does), since
no measured recipe took SmolLM2's MLP norms to g = 0 while its 30 attention norms reached it at +3.3%.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from .calibration import fit_linear_branch
from .patching import tapered_norms
from .regularizers import TokenScalePenalty
from .sink import set_sink_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaperRecipe:
    """One continued-pretraining recipe.

    ``taper_start``/``taper_end``: fractions of the run (the TaperSchedule/TaperCallback arguments).
    ``sink_tokens``: leading positions kept normalized at every gate (every training block must start
    with the same token, e.g. BOS, so the sink's keys/values are constants of the weights, which
    folding stores as a cache prefix; see ``sink.py``). ``calibration_trim``/``per_channel``: the linear branch's fit
    (:func:`fit_linear_branch`); ``trim=None, per_channel=False`` is the paper's least-squares c.
    ``scale_penalty``/``scale_penalty_ratio``: :class:`TokenScalePenalty` (0 = off).
    """

    name: str
    taper_start: float
    taper_end: float
    learning_rate: float
    sink_tokens: int = 1
    calibration_trim: Optional[float] = None
    per_channel: bool = True
    scale_penalty: float = 0.0
    scale_penalty_ratio: float = 4.0


#: Upper parameter-count bounds of the size classes, smallest first. Evidence (SmolLM2-135M,
#: conversion_scripts/experiments/reports/smollm2_fidelity.md): a normalized BOS sink and the per-channel
#: least-squares fit over all non-sink tokens are the best measured calibration (training-free CE at
#: gate 0.9: +1.0% vs +124% for the paper's fit); trimming outliers from the fit and the token-scale
#: penalty did not help in short runs, so they are off. Gates closing faster than the model adapts
#: diverge (a 27-step taper breaks near g = 0.75), hence the long window (5% -> 90% of the run).
#: The medium/large learning rates are scaled down by convention, not measured.
PRESETS: dict[str, tuple[float, TaperRecipe]] = {
    "small": (5e8, TaperRecipe("small", 0.05, 0.9, 5e-5)),
    "medium": (4e9, TaperRecipe("medium", 0.05, 0.9, 3e-5)),
    "large": (float("inf"), TaperRecipe("large", 0.05, 0.9, 1e-5)),
}

#: The paper's recipe, for comparison: no sink, least-squares c, cosine from 5% to 70%.
PAPER = TaperRecipe("paper", 0.05, 0.70, 1e-4, sink_tokens=0, calibration_trim=None, per_channel=False)


def recipe_for(model_or_params: nn.Module | int) -> TaperRecipe:
    """The preset for a model (or a parameter count) by size."""
    count = (
        model_or_params
        if isinstance(model_or_params, int)
        else sum(p.numel() for p in model_or_params.parameters())
    )
    for bound, recipe in PRESETS.values():
        if count <= bound:
            return recipe
    raise AssertionError("unreachable: the last preset has no bound")


def apply_recipe(
    model: nn.Module,
    recipe: TaperRecipe,
    calibration_batches: Optional[Iterable[torch.Tensor | dict]] = None,
    sink_token_ids: Optional[Sequence[int]] = None,
) -> Optional[TokenScalePenalty]:
    """Configure a patched model for ``recipe``; returns the token-scale penalty to add to the loss, if any.

    The recipe's sink positions are the token ids ``sink_token_ids`` (default: the config's BOS for
    a one-token sink); every training sequence must start with them. With ``calibration_batches``
    the linear branches are fitted now (at gate 1, before training): the TaperController/TaperCallback
    then finds them calibrated and only freezes the scale anchor.
    """
    layers = [layer for _, layer in tapered_norms(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no tapered TaperNorm layers; call patch_model(model) first")
    if sink_token_ids is None and recipe.sink_tokens:
        bos = getattr(model.config, "bos_token_id", None)
        if recipe.sink_tokens != 1 or bos is None:
            raise ValueError(
                f"recipe {recipe.name!r} keeps {recipe.sink_tokens} sink token(s): pass sink_token_ids (the ids every "
                "training sequence starts with)"
            )
        sink_token_ids = [bos]
    if len(sink_token_ids or ()) != recipe.sink_tokens:
        raise ValueError(f"recipe {recipe.name!r} keeps {recipe.sink_tokens} sink token(s), got ids {sink_token_ids}")
    set_sink_tokens(model, sink_token_ids)
    if calibration_batches is not None:
        values = fit_linear_branch(
            model, calibration_batches, trim=recipe.calibration_trim, per_channel=recipe.per_channel
        )
        logger.info("recipe %s: fitted %d linear branch(es)", recipe.name, len(values))
    if recipe.scale_penalty > 0:
        return TokenScalePenalty(
            model, weight=recipe.scale_penalty, ratio=recipe.scale_penalty_ratio, sink_tokens=recipe.sink_tokens
        )
    return None


__all__ = ["TaperRecipe", "PRESETS", "PAPER", "recipe_for", "apply_recipe"]
