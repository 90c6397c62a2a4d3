"""Swap the norms of a Hugging Face model for TaperNorm, in place and all at once, and drive their gates."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..architectures.sites import Site, architecture_of, model_type_of, norm_sites
from ..architectures.styles import NormStyle
from ..config import TaperNormConfig
from ..errors import CalibrationError, ConfigurationError, TaperNormError, TaperStateError, UnsupportedModelError
from ..utils import replace_submodule
from .load_watch import install_load_watch
from .saving import mark_saves_as_tapered
from .scale_anchor import ScaleAnchor
from .sink import set_sink_tokens, warn_if_tokenizer_omits_sink
from .taper_norm import TaperNorm, tapered_norms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Replacement:
    site: Site
    layer: TaperNorm


def kept_norm_names(model: nn.Module, patterns: Sequence[str], sites: Optional[list[Site]] = None) -> list[str]:
    """The norms of ``model`` that ``keep_norms`` patterns (fnmatch, qualified names) select; refuses a pattern
    that selects nothing, since a typo would otherwise silently taper the norm it meant to keep."""
    if isinstance(patterns, str):
        patterns = [patterns]
    paths = [site.path for site in (sites if sites is not None else norm_sites(model))]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(path, p) for path in paths)]
    if unmatched:
        raise ConfigurationError(
            f"keep_norms pattern(s) {unmatched} match no norm of {type(model).__name__} ({model_type_of(model)}); "
            f"norms are named like '{paths[0]}' and '{paths[-1]}'{_standing_alone(unmatched, patterns)}"
        )
    return [path for path in paths if any(fnmatch.fnmatchcase(path, p) for p in patterns)]


def _standing_alone(unmatched: Sequence[str], patterns: Sequence[str]) -> str:
    """The hint for ``--keep_norms none,model.norm``: the words the flag reads stand alone, and among other
    patterns they are patterns too, which match no norm."""
    word = next((p for p in ("none", "auto") if p in unmatched), None)
    if word is None or len(patterns) < 2:
        return ""
    meaning = "keeps no norm" if word == "none" else "keeps the recipe's norms"
    return f"; '{word}' {meaning} only when it stands alone (--keep_norms {word}): drop it, or give it alone"


def is_headless(model: nn.Module) -> bool:
    """A base model without its LM head (LlamaModel, GPT2Model): it patches and trains, but fold_model folds a
    causal LM and a tapered checkpoint is one (load_tapered, fold and eval read it as such)."""
    get_head = getattr(model, "get_output_embeddings", None)
    return callable(get_head) and get_head() is None


def wraps_peft_adapters(model: nn.Module) -> bool:
    """A PeftModel (told by its attributes, PEFT need not be installed): its own save writes the adapters alone, and
    its module names are not the base model's, so patching, saving a tapered checkpoint and folding take the base
    model, merged (``model.merge_and_unload()``)."""
    return getattr(model, "peft_config", None) is not None and hasattr(model, "merge_and_unload")


def _refuse_peft_adapters(model: nn.Module) -> None:
    """A PeftModel is patched neither directly (its module names are not the base model's) nor after get_peft_model:
    said before its recipe is derived, which would blame the architecture."""
    if wraps_peft_adapters(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} wraps the model in PEFT adapters: patch the base model before get_peft_model "
            "(docs/usage.md, LoRA / PEFT), or merge the adapters first: model = model.merge_and_unload()"
        )


def _warn_if_headless(model: nn.Module) -> None:
    """Say at the patch, not at the fold or save after training, that a base model cannot be folded or saved."""
    if is_headless(model):
        logger.warning(
            "patch_model: %s has no LM head, so it trains patched but neither fold_model nor save_tapered takes it "
            "(they take a causal LM); to fold or save, patch the model AutoModelForCausalLM loads",
            type(model).__name__,
        )


def plan_patch(model: nn.Module, config: TaperNormConfig) -> list[_Replacement]:
    """Every replacement ``patch_model`` would make, built and checked without touching the model.

    Raises before any change: an unsupported layout, a norm whose arithmetic or eps cannot be read
    (the error names the module), a ``keep_norms`` pattern that matches nothing, a sink token id outside the
    vocabulary, or a config under which no norm would taper.
    """
    existing = next((name for name, _ in tapered_norms(model, include_kept=True)), None)
    if existing is not None:
        raise TaperStateError(
            f"{type(model).__name__} is already patched (found a TaperNorm at '{existing}'); "
            "call patch_model once per model"
        )
    if str(model_type_of(model)).startswith("tapernorm_"):  # a loaded folded export: discovery would blame the layout
        raise TaperStateError(
            f"{type(model).__name__} is a folded export ({model_type_of(model)}): its norms are folded away already, "
            "so there is nothing to patch; patch the original model (or load_tapered a tapered checkpoint)"
        )
    _refuse_peft_adapters(model)
    arch = architecture_of(model)  # the table entry, else automatic discovery (logged)
    sites = norm_sites(model, arch)
    kept = set(kept_norm_names(model, config.keep_norms, sites))
    plan = []
    for site in sites:
        try:
            original = model.get_submodule(site.path)
        except AttributeError:
            raise UnsupportedModelError(
                f"{type(model).__name__} ({arch.model_type}) has no module '{site.path}', which its architecture "
                "entry declares as a norm"
            ) from None
        scope = config.scope
        tapered = scope == "all" or (scope == "final" if site.is_final else scope == "internal")
        tapered = tapered and site.path not in kept
        try:
            layer = TaperNorm.from_norm(original, arch.style, tapered=tapered, ema_rate=config.ema_rate)
            layer.sequence_dim = site.sequence_dim
        except TaperNormError as error:
            raise UnsupportedModelError(f"cannot replace '{site.path}' ({type(original).__name__}): {error}") from None
        plan.append(_Replacement(site, layer))
    try:
        vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        vocab = None
    outside = [i for i in config.sink_token_ids if vocab is not None and i >= vocab]
    if outside:
        raise ConfigurationError(
            f"sink_token_ids {outside} are not token ids of {type(model).__name__}, whose vocabulary has {vocab} "
            "tokens; use the tokenizer's BOS id"
        )
    if not any(r.layer.tapered for r in plan):
        raise ConfigurationError(
            f"nothing would taper in {type(model).__name__}: scope={config.scope!r} with keep_norms "
            f"{config.keep_norms} keeps every norm it covers"
        )
    return plan


def patch_model(
    model: nn.Module,
    config: Optional[TaperNormConfig] = None,
    tokenizer: Any = None,
) -> nn.Module:
    """Replace the model's norms with TaperNorm at gate 1, in place; the outputs do not change.

    ``config`` holds every choice of the recipe (:class:`~hf_tapernorm.TaperNormConfig`); without one,
    ``TaperNormConfig.for_model(model, tokenizer)``: the recipe derived from the model's architecture
    (``tokenizer`` gives the BOS id kept as the attention sink; a warning says when it does not add that BOS
    itself, so the data must). The config is attached to the model as
    ``model.tapernorm_config``, where ``TaperCallback`` and ``TaperController`` read the schedule,
    distillation and scale loss, and saved with tapered checkpoints. From then on the model's
    ``save_pretrained`` (and so every Trainer checkpoint) writes a tapered checkpoint, which
    ``AutoModelForCausalLM`` refuses and ``load_tapered`` reads (layers/saving.py).

    Every replacement is planned and checked before the model is touched, so a failure (the error names
    the module) leaves the model as it was. Which modules are norms comes from the architecture table;
    a model type without an entry is described by automatic discovery (logged). The final norm is
    always wrapped, tapered or not, so its input scale can be observed and anchored (its ``anchor``). A model
    whose weights are not loaded (parameters on the meta device) is refused: patch it after they load.
    """
    model_type_of(model)  # a module that is no Hugging Face model: one clear error before anything else
    _refuse_peft_adapters(model)
    _refuse_weightless(model)
    return _patch(model, config, tokenizer)


def patch_weightless(model: nn.Module, config: TaperNormConfig) -> nn.Module:
    """``patch_model`` of a model on the meta device, which ``patch_model`` refuses: for the package's own
    structure-only copies (the sizes of an export, the FSDP2 teacher rebuilt from its config), whose callers
    read shapes alone or fill every parameter and buffer, the TaperNorm state included, after ``to_empty``."""
    return _patch(model, config, None)


def _refuse_weightless(model: nn.Module) -> None:
    """A model whose weights are not loaded (meta device) would patch into TaperNorms whose gains and state
    hold no values: after ``to_empty`` they are uninitialised memory that loading the plain weights leaves so."""
    weightless = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if weightless is not None:
        raise TaperStateError(
            f"patch_model: {type(model).__name__} has parameters on the meta device ('{weightless}'), so its weights "
            "are not loaded and the TaperNorm gains and state it would get hold no values (to_empty leaves them "
            "uninitialised, and a plain state dict does not fill them); load the weights first, then patch_model"
        )


def _patch(model: nn.Module, config: Optional[TaperNormConfig], tokenizer: Any) -> nn.Module:
    """The body of ``patch_model`` once the model is known to be patchable."""
    if config is None:  # not TaperNormConfig(), which holds the paper's values: say which recipe applies
        config = TaperNormConfig.for_model(model, tokenizer)
        logger.info(
            "patch_model: no config given, so the recipe derived for %s (TaperNormConfig.for_model: %s); pass "
            "TaperNormConfig.paper() for the published one",
            type(model).__name__,
            config.recipe,
        )
    elif not isinstance(config, TaperNormConfig):
        raise ConfigurationError(f"patch_model expects a TaperNormConfig, got {type(config).__name__}")
    plan = plan_patch(model, config)
    _warn_if_headless(model)
    style = plan[0].layer.style
    for replacement in plan:
        site, layer = replacement.site, replacement.layer
        original = model.get_submodule(site.path)
        layer.site_name = site.path
        layer.calibration_scale = float(config.experimental.calibration_scale)
        if layer.tapered and config.experimental.linear_fit == "per_channel":
            layer.enable_per_channel_fit()
        layer.train(original.training)
        if site.is_final:
            layer.anchor = ScaleAnchor(
                centred=style is NormStyle.LAYER,
                eps=layer.eps,
                weight=config.scale_loss_weight,
                ema_rate=config.ema_rate,
                relative=config.relative_scale_loss,
            ).to(layer.gate.device)
            layer.anchor.site_name = site.path
            layer.anchor.train(original.training)
            layer.anchor.attach(model)
        replace_submodule(model, site.path, layer)
    model.tapernorm_config = config
    mark_saves_as_tapered(model)
    install_load_watch(model)  # TaperNorm state of another layout is refused before it loads
    set_sink_tokens(model, config.sink_token_ids)
    if tokenizer is not None:
        warn_if_tokenizer_omits_sink(tokenizer, config.sink_token_ids, stacklevel=4)  # the caller of patch_model
    tapered = sum(r.layer.tapered for r in plan)
    kept = sum(1 for r in plan if not r.layer.tapered and not r.site.is_final)
    logger.info(
        "patched %s (%s), recipe %s: %d norm(s) tapered, %d internal norm(s) kept%s",
        type(model).__name__,
        model_type_of(model),
        config.recipe,
        tapered,
        kept,
        f", sink tokens {config.sink_token_ids} kept normalized" if config.sink_token_ids else "",
    )
    return model


def set_gate(model: nn.Module, gate: float) -> None:
    """Set the one global gate of every tapered layer, in place."""
    gate = float(gate)
    if not 0.0 <= gate <= 1.0:
        raise ConfigurationError(f"gate must be in [0, 1], got {gate}")
    layers = [m for _, m in tapered_norms(model)]
    if not layers:
        raise TaperStateError(f"{type(model).__name__} has no tapered TaperNorm layers; call patch_model(model) first")
    if gate < 1.0:
        missing = [m.site_name for m in layers if not m.is_calibrated]
        if missing:
            raise CalibrationError(
                f"cannot lower the gate below 1 before calibration: {len(missing)} layer(s) are uncalibrated "
                f"(first: {missing[0]}); call calibrate(model) after some training-mode forwards"
            )
    for layer in layers:
        layer.set_gate(gate)


def gate_of(model: nn.Module) -> float:
    """The current global gate (of the first tapered layer)."""
    for _, layer in tapered_norms(model):
        return float(layer.gate)
    raise TaperStateError(f"{type(model).__name__} has no tapered TaperNorm layers")


__all__ = ["gate_of", "kept_norm_names", "patch_model", "patch_weightless", "plan_patch", "set_gate"]
