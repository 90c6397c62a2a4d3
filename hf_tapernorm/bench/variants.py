"""The inference variants: one set of weights, the chosen norms removed in three ways, the original and its peer.

``--norms`` names a ``TaperNormConfig``: ``recipe`` is ``TaperNormConfig.for_model(model)``, the
recipe ``hf-tapernorm taper`` runs by default (on a gated-MLP model it keeps the norms that feed the
MLPs, its ``keep_norms``), so the default benchmark measures what a default export buys; ``internal``
and ``all`` are the paper's Internal- and All-Taper. Which norms go is read from ``plan_patch``, so
``limit`` replaces by identity exactly the norms ``patch_model`` tapers and ``fold_model`` folds.

No sink tokens (``sink_token_ids=[]``) for these speed-only variants: a folded model with a sink holds
the BOS as a cached key/value prefix and must be fed one token fewer than the others, and its only
cost is one more attended position; without a sink every variant reads the same ids, so the timings
and operation counts compare the per-token norm work alone.

``flashnorm`` is the peer a user who wants speed without training picks: the original with every
pre-norm's weight folded into the modules it feeds (FlashNorm, ``export.folding.flashnorm_model``), exact,
so it is compared with the original in ``agreement``. A ``folded`` export's kept RMS pre-norms are made
weightless the same way, so it never runs more operations than ``flashnorm``; it can run fewer than
``limit``, which removes the same norms from the original and leaves the kept ones as they are.

The patched variants are calibrated on random tokens, untrained: their speed and operation counts
are meaningful, their outputs are not (see ``QUALITY_NOTE``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..config import TaperNormConfig
from ..export.folding import flashnorm_model, fold_model
from ..layers.patching import patch_model, plan_patch, set_gate
from ..training.calibration import calibrate
from ..utils import replace_submodule

logger = logging.getLogger(__name__)

QUALITY_NOTE = (
    "explicit/folded variants are calibrated on random tokens without training: their outputs are not "
    "meaningful (a real model may even overflow at g = 0 untrained), their speed and operation counts are"
)


@dataclass(frozen=True)
class VariantSpec:
    """One inference variant: its label in the results, what it is (``kind``) and which norms it removes."""

    label: str
    kind: str
    norms: Optional[str] = None  # None: the original and flashnorm keep every norm


#: The variants of the original itself: one each, whatever ``--norms`` says.
OF_THE_ORIGINAL = ("original", "flashnorm")


def variant_specs(kinds: Sequence[str], norms: Sequence[str]) -> list[VariantSpec]:
    """The variants of ``kinds`` for each ``--norms`` value; labels carry the norms only when there are several."""
    specs = [VariantSpec(kind, kind) for kind in OF_THE_ORIGINAL if kind in kinds]
    for choice in norms:
        for kind in kinds:
            if kind not in OF_THE_ORIGINAL:
                specs.append(VariantSpec(f"{choice}-{kind}" if len(norms) > 1 else kind, kind, choice))
    return specs


def removal_config(model: nn.Module, norms: str) -> TaperNormConfig:
    """The TaperNormConfig whose tapered norms a ``--norms`` value removes (no sink: module docstring)."""
    if norms == "recipe":
        return TaperNormConfig.for_model(model, sink_token_ids=[])
    return TaperNormConfig.paper(scope=norms)


def removed_norms(model: nn.Module, config: TaperNormConfig) -> list[str]:
    """Qualified names of the norms ``patch_model(model, config)`` would taper (the model is not touched)."""
    return [replacement.site.path for replacement in plan_patch(model, config) if replacement.layer.tapered]


def calibrated_copy(model: nn.Module, config: TaperNormConfig, batches: Sequence[torch.Tensor]) -> nn.Module:
    """A patched copy at g = 0, calibrated from training-mode forwards on ``batches`` (no training)."""
    patched = patch_model(copy.deepcopy(model), config)
    patched.train()
    with torch.no_grad():
        for ids in batches:
            patched(input_ids=ids, use_cache=False)
    calibrate(patched)
    set_gate(patched, 0.0)
    return patched.eval()


def limit_copy(model: nn.Module, config: TaperNormConfig) -> nn.Module:
    """A copy with the norms ``config`` tapers replaced by ``nn.Identity``: the same weights, no norm work."""
    limit = copy.deepcopy(model)
    for path in removed_norms(limit, config):
        replace_submodule(limit, path, nn.Identity())
    return limit.eval()


@torch.no_grad()
def finite_logits(model: nn.Module) -> bool:
    """Whether a fixed random batch gives finite logits (an untrained g = 0 model may overflow)."""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 16), generator=generator).to(next(model.parameters()).device)
    return bool(torch.isfinite(model(input_ids=ids, use_cache=False).logits).all())


class _UntieAsInfo(logging.Filter):
    """fold's WARNING that a tied head is untied advises ``tied_head='scale'``, which no bench option sets (bench keeps
    no export; its folded variants are what fold writes by default): logged as INFO while bench folds."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "folds into a tied lm_head" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _folded_quietly(fold, *args, **kwargs) -> nn.Module:
    """``fold(*args, **kwargs)`` with _UntieAsInfo on the folding log."""
    folding_log, untie = logging.getLogger(fold.__module__), _UntieAsInfo()
    folding_log.addFilter(untie)
    try:
        return fold(*args, **kwargs)
    finally:
        folding_log.removeFilter(untie)


def _reloaded(model: nn.Module, folder: Path, dtype: torch.dtype, device: str) -> nn.Module:
    """Save ``model`` and load it back from disk through ``AutoModelForCausalLM``, as a user would."""
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def folded_reload(explicit: nn.Module, folder: Path, dtype: torch.dtype, device: str) -> nn.Module:
    """Fold a g = 0 model, save it, and reload it from disk through ``AutoModelForCausalLM``, as a user would."""
    check = finite_logits(explicit)
    if not check:
        logger.warning(
            "%s at g = 0 gives non-finite logits without training (expected: the taper needs training); "
            "folding without the numerical check: speed and operation counts are unaffected",
            type(explicit).__name__,
        )
    return _reloaded(_folded_quietly(fold_model, explicit, check=check), folder, dtype, device)


def flashnorm_reload(model: nn.Module, folder: Path, dtype: torch.dtype, device: str) -> nn.Module:
    """The FlashNorm fold of the original (checked against it), saved and reloaded like ``folded``."""
    return _reloaded(_folded_quietly(flashnorm_model, model), folder, dtype, device)


def build_variants(
    model: nn.Module, specs: Sequence[VariantSpec], *, calibration_batches: Sequence[torch.Tensor], workdir: Path
) -> dict[str, nn.Module]:
    """Every variant of ``specs`` (labels in order); ``model`` itself is ``original`` and stays unchanged.

    ``explicit`` and ``folded`` of the same norms share one calibrated copy, so the folded model is
    the fold of exactly the explicit one that ``agreement`` compares it with.
    """
    dtype, device = next(model.parameters()).dtype, str(next(model.parameters()).device)
    explicit: dict[str, nn.Module] = {}
    built: dict[str, nn.Module] = {}
    for spec in specs:
        if spec.kind == "original":
            built[spec.label] = model
            continue
        if spec.kind == "flashnorm":
            built[spec.label] = flashnorm_reload(model, workdir / spec.label, dtype, device)
            continue
        config = removal_config(model, spec.norms)
        if spec.kind == "limit":
            built[spec.label] = limit_copy(model, config)
            continue
        if spec.norms not in explicit:
            explicit[spec.norms] = calibrated_copy(model, config, calibration_batches)
        if spec.kind == "explicit":
            built[spec.label] = explicit[spec.norms]
        else:
            built[spec.label] = folded_reload(explicit[spec.norms], workdir / spec.label, dtype, device)
    return built


def limit_labels(specs: Sequence[VariantSpec]) -> dict[str, str]:
    """``{label: label of the limit removing the same norms}`` for every variant that has one."""
    limits = {spec.norms: spec.label for spec in specs if spec.kind == "limit"}
    return {s.label: limits[s.norms] for s in specs if s.norms in limits and s.kind != "limit"}


#: What each fold is compared with in ``agreement``: the model it was folded from.
SOURCES = {"folded": "explicit", "flashnorm": "original"}


@torch.no_grad()
def agreement(
    variants: dict[str, nn.Module], specs: Sequence[VariantSpec], ids: torch.Tensor
) -> dict[str, dict[str, float]]:
    """Last-position logits of each folded variant against its explicit (unfolded g = 0) source, and of
    flashnorm against the original: each fold is exact, so these are rounding.

    Differences are taken over the entries finite in both (an untrained g = 0 model may overflow);
    ``same_nonfinite`` says whether both overflow at exactly the same entries.
    """
    by_kind = {(spec.norms, spec.kind): spec.label for spec in specs}
    result = {}
    for (norms, kind), folded in by_kind.items():
        source = by_kind.get((norms, SOURCES[kind])) if kind in SOURCES else None
        if source is None:
            continue
        a = variants[folded](input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
        b = variants[source](input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
        finite = torch.isfinite(a) & torch.isfinite(b)
        diff = (a - b)[finite].abs().max().item() if finite.any() else float("nan")
        scale = b[finite].abs().max().item() if finite.any() else float("nan")
        result[f"{folded}_vs_{source}"] = {
            "max_abs": diff,
            "max_rel": diff / max(scale, 1e-30),
            "finite_fraction": finite.float().mean().item(),
            "same_nonfinite": torch.equal(torch.isfinite(a), torch.isfinite(b)),
        }
    return result


__all__ = [
    "OF_THE_ORIGINAL",
    "QUALITY_NOTE",
    "SOURCES",
    "VariantSpec",
    "agreement",
    "build_variants",
    "calibrated_copy",
    "finite_logits",
    "flashnorm_reload",
    "folded_reload",
    "limit_copy",
    "limit_labels",
    "removal_config",
    "removed_norms",
    "variant_specs",
]
