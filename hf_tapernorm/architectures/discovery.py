"""Describe the norms of an architecture that has no table entry, by watching one probe forward.

The table in ``table.py`` is written by hand from each modeling file. For any other model
this module finds the norm modules by type, runs one short forward under a ``TorchFunctionMode`` with
module hooks, and follows every norm's output (and input) through the ops that read it. A norm can
be folded only if, at gate 0, its per-channel map can move into linear weights:

- ``"input"``: its output reaches nothing but linear projections (through views, casts, dropout),
- ``"per_head"`` / ``"output"``: its input is the output of one linear projection that nothing else
  reads (split into heads or not), so the map folds into that projection's output rows.

Anything else (a norm output added to the residual stream, fed to an activation, sliced across
channels) is refused with the module's name and the op that reads it: folding it would be wrong.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Optional

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import UnsupportedModelError
from ..utils import base_model_prefix
from .probe import LINEAR_TYPES, PROBE_LENGTH, Observations, probe_forward
from .styles import NormStyle, norm_eps, norm_hidden_size, normalize
from .table import Architecture, NormSite

logger = logging.getLogger(__name__)

_NOT_NORMS = ("BatchNorm", "GroupNorm", "InstanceNorm")


class DiscoveryError(UnsupportedModelError):
    """The model's norms cannot be described as foldable norm sites (the message says which and why)."""


def is_taper_norm(module: nn.Module) -> bool:
    """A TaperNorm, recognised by its marker so this layer need not import the layer above it."""
    return getattr(module, "is_taper_norm", False) is True


def is_norm_module(module: nn.Module) -> bool:
    """RMSNorm/LayerNorm-like modules (any class named ``*RMSNorm``/``*LayerNorm``), and TaperNorm."""
    if is_taper_norm(module) or isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and not any(n in name for n in _NOT_NORMS)


def detect_style(norm: nn.Module, name: str, size: Optional[int] = None) -> tuple[NormStyle, bool, float]:
    """Which arithmetic reproduces ``norm`` (checked numerically on random rows), whether it does so bit for
    bit (False: the same formula, rounded differently in a low-precision dtype), and the norm's eps.

    The candidates are ``normalize`` with the module's own weight, bias and eps: exactly what the TaperNorm
    that replaces it computes at gate 1, so a norm is accepted only where that replacement leaves the model
    unchanged. A subclass of ``nn.LayerNorm`` is checked like any other module: its forward may apply
    another gain (Nemotron's LayerNorm1P multiplies by ``1 + weight``).

    ``size``: the channel count when the module holds no weight and no ``normalized_shape`` (read from
    the probe forward); the eps is measured when the module has no eps attribute.
    """
    if is_taper_norm(norm):
        return norm.style, True, norm.eps
    if type(norm) is nn.LayerNorm:
        return NormStyle.LAYER, True, float(norm.eps)
    reference = next(iter(norm.parameters()), None)
    dtype = reference.dtype if reference is not None else torch.float32
    device = reference.device if reference is not None else None
    generator = torch.Generator().manual_seed(0)
    try:
        size = norm_hidden_size(norm, size)
    except UnsupportedModelError as error:
        raise DiscoveryError(f"norm '{name}': {error}") from None
    x = (3.0 * torch.randn(4, size, generator=generator) + 0.5).to(device=device, dtype=dtype)
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    with torch.no_grad():
        expected = norm(x)
        candidates = {}
        for style in (NormStyle.RMS, NormStyle.RMS_OFFSET, NormStyle.LAYER):
            try:
                eps = norm_eps(norm, style, size)
            except UnsupportedModelError:
                continue
            candidates[style] = (normalize(x, style, weight, bias if style is NormStyle.LAYER else None, eps), eps)
    for style, (candidate, eps) in candidates.items():
        if candidate.shape == expected.shape and torch.equal(candidate, expected):
            return style, True, eps
    # Same formula, different rounding (e.g. OLMo2 multiplies by w before casting back from fp32).
    rtol = 4 * torch.finfo(dtype).eps
    for style, (candidate, eps) in candidates.items():
        if candidate.shape == expected.shape and torch.allclose(candidate, expected, rtol=rtol, atol=1e-6):
            return style, False, eps
    raise DiscoveryError(
        f"norm '{name}' ({type(norm).__name__}) computes something other than weight * normalized x in the forms "
        "TaperNorm reproduces: RMSNorm (w * x / rms), Gemma's RMSNorm ((1 + w) * x / rms), LayerNorm "
        "(w * (x - mean) / std + b); a TaperNorm in its place would change the model's outputs, so hf_tapernorm "
        "cannot replace it"
    )


def _out_features(module: nn.Module) -> int:
    return module.nf if isinstance(module, Conv1D) else module.out_features


def _sequence_dim(shape: Optional[tuple[int, ...]]) -> int:
    """-3 for a per-head norm fed ``[batch, seq, heads, head_dim]`` (before the head transpose), else -2."""
    if shape is not None and len(shape) >= 4 and shape[-3] == PROBE_LENGTH and shape[-2] != PROBE_LENGTH:
        return -3
    return -2


#: Class names of mixture-of-experts modules in transformers: the block, its router, its stacked experts
#: (MixtralSparseMoeBlock, OlmoeTopKRouter, Qwen2MoeExperts, DeepseekV3MoE, Llama4TextMoe, ...).
_MOE_CLASS = re.compile(r"SparseMoe|MoE$|Moe(Block|Layer|MLP)?$|Experts?$|Router$")


def _moe_block(path: str, modules: dict[str, nn.Module]) -> str:
    """The outermost of ``path`` and its enclosing modules that are all mixture-of-experts parts."""
    block, parts = path, path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        if parent not in modules or not _MOE_CLASS.search(type(modules[parent]).__name__):
            break
        block = parent
    return block


def _mixture_of_experts_reader(name: str, seen: Observations, modules: dict[str, nn.Module]) -> Optional[str]:
    """The refusal of a norm whose output a mixture-of-experts block reads with its own ops (a router's or the
    experts' raw weights, not linear projection modules), or None when no such block reads it."""
    for path, op in dict.fromkeys(seen.op_sites[name]):
        module = modules.get(path)
        if module is None or not _MOE_CLASS.search(type(module).__name__):
            continue
        block = _moe_block(path, modules)
        reader = "the block itself" if block == path else f"'{path}' ({type(module).__name__})"
        return (
            f"norm '{name}' feeds the mixture-of-experts block '{block}' ({type(modules[block]).__name__}), which a "
            f"norm cannot be folded into: {reader} reads it with the op '{op}', not through a linear projection "
            "module; mixture-of-experts models are not supported, taper a dense model"
        )
    return None


def _classify(name: str, seen: Observations, modules: dict[str, nn.Module], size: int, is_outside: bool) -> NormSite:
    """The norm's site (paths still absolute), or a DiscoveryError naming the norm and the reason."""
    if seen.calls[name] == 0:
        raise DiscoveryError(f"norm '{name}' is never called in a forward, so what it feeds cannot be observed")
    consumers = tuple(dict.fromkeys(seen.consumers[name]))
    bad = list(dict.fromkeys(seen.uses[name]))
    if not bad and (consumers or is_outside):
        return NormSite(name, consumers, "input")
    producers = set(seen.norm_inputs[name])
    if len(producers) == 1 and None not in producers:
        producer = producers.pop()
        others = list(dict.fromkeys(seen.uses[producer]))
        if not others and set(seen.readers_of_linear[producer]) == {name}:
            out = _out_features(modules[producer])
            if out == size:
                return NormSite(name, (producer,), "output")
            if out % size == 0:
                return NormSite(name, (producer,), "per_head", sequence_dim=_sequence_dim(seen.shapes.get(name)))
    moe = _mixture_of_experts_reader(name, seen, modules) if bad else None
    if moe is not None:
        raise DiscoveryError(moe)
    if bad:
        reason = f"its output reaches {bad[0]}, which is not a linear projection"
        if producers != {None}:
            reason += ", and its input is not the sole output of one linear projection"
    else:
        reason = "its output is never read by a linear projection"
    raise DiscoveryError(f"norm '{name}' cannot be folded: {reason}; refusing rather than folding it wrongly")


def _relative(path: str, layer_prefix: str, norm: str) -> str:
    if not path.startswith(layer_prefix):
        raise DiscoveryError(
            f"norm '{norm}' is folded into '{path}', outside its own layer '{layer_prefix.rstrip('.')}'"
        )
    return path[len(layer_prefix) :]


_ATTENTION_LEAVES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "query_key_value",
    "c_attn",
    "wqkv",
    "query",
    "key",
    "value",
    "in_proj",
)
_QK_LEAVES = ("q_proj", "k_proj", "query", "key", "wq", "wk")


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1].lower()


def _role(site: NormSite) -> str:
    """What a discovered site feeds, from the names of the projections it folds into (recipe_rules.py)."""
    if site.kind == "per_head":
        return "qk"
    if site.kind == "output":
        producer = site.consumers[0]
        if _leaf(producer) in _QK_LEAVES:
            return "qk"
        parts = producer.lower().split(".")
        return "attention_output" if any("attn" in p or "attention" in p for p in parts) else "mlp_output"
    attention = [c for c in site.consumers if _leaf(c) in _ATTENTION_LEAVES]
    if attention and len(attention) < len(site.consumers):
        return "attention_mlp"
    return "attention" if attention else "mlp"


def _has_gated_mlp(layer: nn.Module) -> bool:
    """SwiGLU/GeGLU MLPs multiply two projections; transformers names the gating one ``gate_proj``/``gate_up_proj``."""
    return any(isinstance(m, LINEAR_TYPES) and _leaf(n).startswith("gate_") for n, m in layer.named_modules())


def _one_style(model: nn.Module, modules: dict, norms: dict, seen) -> NormStyle:
    """The arithmetic every norm of ``model`` shares (one style per model; rounding-only matches are logged)."""
    detected = {name: detect_style(module, name, seen.sizes.get(name)) for module, name in norms.items()}
    styles = {name: style for name, (style, _, _) in detected.items()}
    rounded = sorted({type(modules[name]).__name__ for name, (_, exact, _) in detected.items() if not exact})
    if rounded:
        logger.warning(
            "norm class(es) %s match the TaperNorm arithmetic only up to rounding in this dtype: at g = 1 the "
            "patched model equals the original within rounding, not bit for bit",
            ", ".join(rounded),
        )
    if len(set(styles.values())) > 1:
        listing = ", ".join(f"{n}: {s.value}" for n, s in styles.items())
        raise DiscoveryError(
            f"{type(model).__name__} mixes norm arithmetics ({listing}); one style per model is supported"
        )
    return next(iter(styles.values()))


def _decoder_layer_of_each_norm(norms: dict, prefix: str, base: nn.Module) -> dict[str, str]:
    """``{norm name: its decoder layer's prefix}``: the ModuleList of the base model whose items hold the norms."""
    layers_of: dict[str, str] = {}
    for name in norms.values():
        parts = name[len(prefix) :].split(".") if name.startswith(prefix) else []
        for cut in range(len(parts) - 1, 0, -1):
            head = ".".join(parts[:cut])
            if parts[cut].isdigit() and isinstance(base.get_submodule(head), nn.ModuleList):
                layers_of[name] = f"{prefix}{head}.{parts[cut]}."
                break
    return layers_of


def discover_architecture(model: nn.Module) -> Architecture:
    """Build the table-style description of ``model``'s norms from one probe forward.

    Works on a plain or an already patched model (TaperNorms count as norms). Raises
    ``DiscoveryError`` naming the module and the reason when a norm cannot be folded.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    base = getattr(model, "base_model", model)
    prefix = base_model_prefix(model)
    modules = dict(model.named_modules())
    norms = {m: n for n, m in modules.items() if is_norm_module(m)}
    if not norms:
        raise DiscoveryError(f"{type(model).__name__} has no RMSNorm/LayerNorm modules to replace")
    try:
        seen = probe_forward(model, norms)
    except UnsupportedModelError as error:
        raise DiscoveryError(str(error)) from error.__cause__
    style = _one_style(model, modules, norms, seen)

    layers_of = _decoder_layer_of_each_norm(norms, prefix, base)
    # Every norm must be foldable on its own before the layout as a whole is checked.
    sites = {
        name: _classify(name, seen, modules, norm_hidden_size(module, seen.sizes.get(name)), name not in layers_of)
        for module, name in norms.items()
    }
    lists = {p.rsplit(".", 2)[0] for p in layers_of.values()}
    if len(lists) != 1:
        raise DiscoveryError(
            f"{type(model).__name__}: expected the norms inside one list of decoder layers, "
            f"found {sorted(lists) or 'none'}"
        )
    layers = lists.pop()[len(prefix) :]
    outside = [n for n in norms.values() if n not in layers_of]
    if len(outside) != 1:
        raise DiscoveryError(
            f"{type(model).__name__}: expected exactly one norm outside the decoder layers (the final norm), "
            f"found {outside or 'none'}"
        )
    final = outside[0]
    per_layer: dict[str, list[NormSite]] = defaultdict(list)
    for name, layer_prefix in layers_of.items():
        site = sites[name]
        relative = NormSite(
            _relative(name, layer_prefix, name),
            tuple(_relative(c, layer_prefix, name) for c in site.consumers),
            site.kind,
        )
        per_layer[layer_prefix].append(
            NormSite(relative.path, relative.consumers, relative.kind, _role(relative), site.sequence_dim)
        )
    final_site = sites[final]
    descriptions = {p: tuple(sorted(s, key=lambda x: x.path)) for p, s in per_layer.items()}
    first_prefix, layer_sites = next(iter(descriptions.items()))
    for layer_prefix, other in descriptions.items():
        if other != layer_sites:
            raise DiscoveryError(
                f"{type(model).__name__}: layer '{layer_prefix.rstrip('.')}' has norm sites {other}, unlike "
                f"'{first_prefix.rstrip('.')}' {layer_sites}; per-layer layouts are not supported"
            )
    if final_site.kind != "input" or len(final_site.consumers) > 1:
        raise DiscoveryError(f"final norm '{final}' must feed one linear head; it feeds {final_site.consumers}")
    head = final_site.consumers[0] if final_site.consumers else "lm_head"
    return Architecture(
        model_type=model_type,
        style=style,
        layers=layers,
        sites=layer_sites,
        final_norm=final[len(prefix) :],
        lm_head=head,
        gated_mlp=_has_gated_mlp(modules[first_prefix.rstrip(".")]),
    )


__all__ = ["DiscoveryError", "detect_style", "discover_architecture", "is_norm_module", "is_taper_norm"]
