"""Swap the norms of a Hugging Face model for TaperNorm, in place, and drive their gates."""

from __future__ import annotations

import fnmatch
import logging
from typing import Iterator, Literal, Optional, Sequence

from torch import nn

from .architectures import Architecture
from .discovery import architecture_of
from .scale_loss import ScaleAnchor
from .taper_norm import NormStyle, TaperNorm

logger = logging.getLogger(__name__)

Scope = Literal["internal", "final", "all"]
_SCOPES = ("internal", "final", "all")


def base_model_of(model: nn.Module) -> nn.Module:
    """The bare transformer (``LlamaModel``, ``GPT2Model``) of a ``*ForCausalLM`` or of itself."""
    return getattr(model, "base_model", model)


def model_type_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(
            f"{type(model).__name__} has no config.model_type; patch_model expects a Hugging Face "
            "PreTrainedModel such as LlamaForCausalLM or GPT2LMHeadModel"
        )
    return model_type


def taper_norms(model: nn.Module) -> Iterator[tuple[str, TaperNorm]]:
    """Every TaperNorm of the model with its qualified name, tapered or kept."""
    for name, module in model.named_modules():
        if isinstance(module, TaperNorm):
            yield name, module


def tapered_norms(model: nn.Module) -> Iterator[tuple[str, TaperNorm]]:
    """The TaperNorms whose gate the schedule drives (kept final norms excluded)."""
    return ((n, m) for n, m in taper_norms(model) if m.tapered)


def is_patched(model: nn.Module) -> bool:
    return any(True for _ in taper_norms(model))


def set_gate(model: nn.Module, gate: float) -> None:
    """Set the one global gate of every tapered layer, in place."""
    gate = float(gate)
    if not 0.0 <= gate <= 1.0:
        raise ValueError(f"gate must be in [0, 1], got {gate}")
    layers = [m for _, m in tapered_norms(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no tapered TaperNorm layers; call patch_model(model) first")
    if gate < 1.0:
        missing = [m.site_name for m in layers if not m.is_calibrated]
        if missing:
            raise RuntimeError(
                f"cannot lower the gate below 1 before calibration: {len(missing)} layer(s) are uncalibrated "
                f"(first: {missing[0]}); call calibrate(model) after some training-mode forwards"
            )
    for layer in layers:
        layer.set_gate(gate)


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, child, new)


def norm_sites(model: nn.Module, arch: Architecture) -> Iterator[tuple[str, str, bool]]:
    """(path from ``model``, site kind, is_final) for every norm the architecture declares."""
    base = base_model_of(model)
    prefix = next((n + "." for n, m in model.named_modules() if m is base and n), "")
    layers = base.get_submodule(arch.layers)
    for index in range(len(layers)):
        for site in arch.sites:
            yield f"{prefix}{arch.layers}.{index}.{site.path}", site.kind, False
    yield f"{prefix}{arch.final_norm}", "input", True


def kept_norm_names(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The norms of ``model`` that ``keep_norms`` patterns (fnmatch, qualified names) select; refuses a pattern
    that selects nothing, since a typo would otherwise silently taper the norm it meant to keep."""
    paths = [path for path, _, _ in norm_sites(model, architecture_of(model))]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(path, p) for path in paths)]
    if unmatched:
        raise ValueError(
            f"keep_norms pattern(s) {unmatched} match no norm of {type(model).__name__} ({model_type_of(model)}); "
            f"norms are named like '{paths[0]}' and '{paths[-1]}'"
        )
    return [path for path in paths if any(fnmatch.fnmatchcase(path, p) for p in patterns)]


def norms_feeding_gated_mlps(model: nn.Module) -> list[str]:
    """Qualified names of the internal norms whose output feeds a gated MLP (SwiGLU/GeGLU ``gate_proj``).

    Such an MLP multiplies two projections of its input, so once the norm in front of it is a fixed
    linear map its output grows like the square of a token's residual scale, and a token above the
    typical scale grows from layer to layer until it overflows. Attention and plain (GELU) MLPs do
    not square it. Measured on SmolLM2: no taper of all internal norms got below g = 0.36 with its
    quality kept, whatever the schedule, penalty or data order, while tapering only the norms that
    feed attention reached g = 0 at +3.3% held-out CE
    (conversion_scripts/experiments/reports/smollm2_fidelity.md, "Session 3"). Pass the result as
    ``patch_model(keep_norms=...)``; empty for architectures without a gated MLP.
    """
    arch = architecture_of(model)
    gated = [
        site.path for site in arch.sites
        if any(consumer.rsplit(".", 1)[-1].startswith("gate") for consumer in site.consumers)
    ]
    return [
        path for path, _, is_final in norm_sites(model, arch)
        if not is_final and any(path.endswith("." + site) for site in gated)
    ]


def patch_model(
    model: nn.Module,
    scope: Scope = "internal",
    *,
    ema_rate: float = 0.01,
    scale_loss_weight: float = 0.1,
    relative_scale_loss: bool = False,
    sink_token_ids: Optional[Sequence[int]] = None,
    calibration_scale: float = 1.0,
    keep_norms: Sequence[str] = (),
) -> nn.Module:
    """Replace the model's norms with TaperNorm at gate 1, in place; the outputs do not change.

    ``scope`` chooses which norms taper: ``"internal"`` (every norm inside the decoder layers, the
    default: the kept final norm anchors the output scale), ``"final"`` or ``"all"``. The final
    norm is always wrapped, tapered or not, so its input scale can be observed and anchored: it
    carries a ``ScaleAnchor`` whose fixed-target scale loss (weight ``scale_loss_weight``, lambda
    of METHOD section 4; 0 disables the loss but keeps the measurement) is added to the training
    loss from calibration on; ``relative_scale_loss`` divides the deviation by the target
    (``(s / s_tgt - 1)^2``), for models whose residual scale is far from 1.

    ``sink_token_ids`` (e.g. ``[tokenizer.bos_token_id]``) keeps the first positions normalized at
    every gate, for models with a massive-activation attention sink on their first token (most
    pretrained Llama-family models); every sequence must then start with exactly these ids, and
    folding stores their keys/values as a constant prefix (``sink.py``). Default: none (the paper).
    ``calibration_scale`` multiplies every calibrated c (default 1, the paper's least-squares c);
    below 1 the linear branch under-shoots the norm, which delays the runaway of above-typical tokens.
    ``keep_norms``: fnmatch patterns of qualified module names (``"model.layers.*.post_attention_layernorm"``)
    whose norms stay real norms although ``scope`` covers them; :func:`norms_feeding_gated_mlps` gives
    the ones a SwiGLU model cannot lose (README, Fidelity). Every pattern must match a norm.

    Which modules are norms comes from the architecture table; a model type without an entry is
    described by automatic discovery (``discovery.py``, logged), which refuses, naming the module,
    any norm whose output reaches something other than a linear projection.
    """
    if scope not in _SCOPES:
        raise ValueError(f"scope must be one of {', '.join(_SCOPES)}, got {scope!r}")
    existing = next((name for name, _ in taper_norms(model)), None)
    if existing is not None:
        raise ValueError(
            f"{type(model).__name__} is already patched (found a TaperNorm at '{existing}'); "
            "call patch_model once per model"
        )
    model_type = model_type_of(model)
    arch = architecture_of(model)  # the table entry, else automatic discovery (logged)
    if not calibration_scale > 0:
        raise ValueError(f"calibration_scale must be positive, got {calibration_scale}")
    kept_paths = set(kept_norm_names(model, keep_norms))
    replaced = kept = 0
    for path, _kind, is_final in list(norm_sites(model, arch)):
        original = model.get_submodule(path)
        tapered = (scope == "all") or (scope == "final" if is_final else scope == "internal")
        if tapered and path in kept_paths:
            tapered, kept = False, kept + 1
        layer = TaperNorm.from_norm(original, arch.style, tapered=tapered, ema_rate=ema_rate)
        layer.site_name = path
        layer.calibration_scale = float(calibration_scale)
        layer.train(original.training)
        if is_final:
            layer.anchor = ScaleAnchor(
                centred=arch.style is NormStyle.LAYER,
                eps=layer.eps,
                weight=scale_loss_weight,
                ema_rate=ema_rate,
                relative=relative_scale_loss,
            ).to(layer.gate.device)
            layer.anchor.site_name = path
            layer.anchor.train(original.training)
            layer.anchor.attach(model)
        _replace(model, path, layer)
        replaced += tapered
    if sink_token_ids is None:
        sink_token_ids = getattr(model.config, "tapernorm_sink_token_ids", None)  # a saved patched checkpoint
    if sink_token_ids:
        from .sink import set_sink_tokens

        set_sink_tokens(model, sink_token_ids)
    logger.info("patched %s (%s): %d norm(s) tapered, scope=%s%s%s", type(model).__name__, model_type, replaced, scope,
                f", {kept} kept by keep_norms ({len(keep_norms)} pattern(s), e.g. '{keep_norms[0]}')" if kept else "",
                f", sink tokens {list(sink_token_ids)} kept normalized" if sink_token_ids else "")
    return model


def gate_of(model: nn.Module) -> float:
    """The current global gate (of the first tapered layer)."""
    for _, layer in tapered_norms(model):
        return float(layer.gate)
    raise ValueError(f"{type(model).__name__} has no tapered TaperNorm layers")


__all__ = ["patch_model", "norms_feeding_gated_mlps", "taper_norms", "tapered_norms", "set_gate", "gate_of", "is_patched", "base_model_of"]
