"""Describe the norms of an architecture that has no table entry, by watching one probe forward.

The table in ``architectures.py`` is written by hand from each modeling file. For any other model
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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from transformers.pytorch_utils import Conv1D

from .architectures import ARCHITECTURES, Architecture, NormSite, architecture_for, supported_model_types
from .taper_norm import NormStyle, TaperNorm

logger = logging.getLogger(__name__)

_LINEAR_TYPES = (nn.Linear, Conv1D)
_NOT_NORMS = ("BatchNorm", "GroupNorm", "InstanceNorm")
# Ops through which a tensor keeps its channels (last dimension) in place; they pass tracking on.
_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach", "dropout"}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}
_TRANSPOSES = {"transpose", "swapaxes", "permute"}


class DiscoveryError(ValueError):
    """The model's norms cannot be described as foldable norm sites (the message says which and why)."""


def is_norm_module(module: nn.Module) -> bool:
    """RMSNorm/LayerNorm-like modules (any class named ``*RMSNorm``/``*LayerNorm``), and TaperNorm."""
    if isinstance(module, (TaperNorm, nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and not any(n in name for n in _NOT_NORMS)


def detect_style(norm: nn.Module, name: str) -> tuple[NormStyle, bool]:
    """Which TaperNorm arithmetic reproduces ``norm`` (checked numerically on random rows), and whether
    it does so bit for bit (False: the same formula, rounded differently in a low-precision dtype)."""
    if isinstance(norm, TaperNorm):
        return norm.style, True
    if isinstance(norm, nn.LayerNorm):
        return NormStyle.LAYER, True
    reference = next(iter(norm.parameters()), None)
    dtype = reference.dtype if reference is not None else torch.float32
    device = reference.device if reference is not None else None
    generator = torch.Generator().manual_seed(0)
    try:
        size = TaperNorm.from_norm(norm, NormStyle.RMS).hidden_size
    except ValueError as error:
        raise DiscoveryError(f"norm '{name}': {error}") from None
    x = (3.0 * torch.randn(4, size, generator=generator) + 0.5).to(device=device, dtype=dtype)
    with torch.no_grad():
        expected = norm(x)
        candidates = {
            style: TaperNorm.from_norm(norm, style, tapered=False).eval()(x)
            for style in (NormStyle.RMS, NormStyle.RMS_OFFSET, NormStyle.LAYER)
        }
    for style, candidate in candidates.items():
        if candidate.shape == expected.shape and torch.equal(candidate, expected):
            return style, True
    # Same formula, different rounding (e.g. OLMo2 multiplies by w before casting back from fp32).
    rtol = 4 * torch.finfo(dtype).eps
    for style, candidate in candidates.items():
        if candidate.shape == expected.shape and torch.allclose(candidate, expected, rtol=rtol, atol=1e-6):
            return style, False
    raise DiscoveryError(
        f"norm '{name}' ({type(norm).__name__}) computes neither RMSNorm (w * x / rms), Gemma's RMSNorm "
        "((1 + w) * x / rms) nor LayerNorm; hf_tapernorm cannot replace it"
    )


@dataclass
class _Root:
    """Where a tracked tensor comes from: a norm's output or a linear projection's output."""

    kind: str  # "norm" | "linear"
    name: str


@dataclass
class _Observations:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    consumers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # norm -> linears
    uses: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # root -> other readers
    norm_inputs: dict[str, list[Optional[str]]] = field(default_factory=lambda: defaultdict(list))  # norm -> producer
    readers_of_linear: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # linear -> norms


def _index_keeps_last_dim(index: Any, ndim: int) -> bool:
    entries = index if isinstance(index, tuple) else (index,)
    if any(e is Ellipsis for e in entries):
        last = entries[-1]
    elif sum(e is not None for e in entries) < ndim:
        return True
    else:
        last = [e for e in entries if e is not None][-1]
    return isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and last.stop is None


def _keeps_channels(
    name: str, args: tuple, kwargs: dict, source: torch.Tensor, result: torch.Tensor, split_ok: bool
) -> bool:
    """Whether ``result`` holds ``source``'s channels in its last dimension, unmixed.

    ``split_ok`` also accepts reshapes that split the channels into heads (``[..., H*d] -> [..., H, d]``),
    which keeps a per-channel map on a projection's output expressible per head.
    """
    if result.dim() == 0 or source.dim() == 0:
        return False
    if name in _CASTS:
        return result.shape == source.shape
    if name in _RESHAPES:
        if result.shape[-1] == source.shape[-1]:
            return True
        lead = source.dim() - 1
        splits = source.shape[-1] % result.shape[-1] == 0 and tuple(result.shape[:lead]) == tuple(source.shape[:lead])
        return split_ok and splits
    if name in _TRANSPOSES:
        last = source.dim() - 1
        if name == "permute":
            dims = args[1:] if len(args) > 2 or not isinstance(args[1], (tuple, list)) else args[1]
            dims = kwargs.get("dims", dims)
            return dims[-1] % source.dim() == last
        dims = [d % source.dim() for d in (args[1:3] if len(args) >= 3 else (kwargs.get("dim0"), kwargs.get("dim1")))]
        return last not in dims
    if name == "__getitem__":
        return result.shape[-1] == source.shape[-1] and _index_keeps_last_dim(args[1], source.dim())
    return False


class _Probe(TorchFunctionMode):
    """Tracks norm and linear outputs through one forward and records who reads them."""

    def __init__(self, model: nn.Module, norms: dict[nn.Module, str]) -> None:
        super().__init__()
        self.norms = norms
        self.linears = {m: n for n, m in model.named_modules() if isinstance(m, _LINEAR_TYPES)}
        self.seen = _Observations()
        self.tracked: dict[int, tuple[_Root, torch.Tensor]] = {}  # strong refs: ids are never reused
        self.opaque = 0  # > 0 inside a norm or a linear: their own arithmetic is not a "use"
        self.handles = []
        for module in set(norms) | set(self.linears):
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _track(self, tensor: torch.Tensor, root: _Root) -> None:
        self.tracked[id(tensor)] = (root, tensor)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.opaque == 0:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            source = self.tracked.get(id(tensors[0]), (None, None))[0] if tensors else None
            if module in self.norms:
                name = self.norms[module]
                self.seen.calls[name] += 1
                self.seen.norm_inputs[name].append(source.name if source and source.kind == "linear" else None)
                if source is not None and source.kind == "linear":
                    self.seen.readers_of_linear[source.name].append(name)
                elif source is not None:
                    self.seen.uses[source.name].append(f"the norm '{name}'")
            elif source is not None:
                name = self.linears[module]
                if source.kind == "norm":
                    self.seen.consumers[source.name].append(name)
                else:
                    self.seen.uses[source.name].append(f"the linear projection '{name}'")
        self.opaque += 1

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.opaque -= 1
        if self.opaque == 0 and isinstance(output, torch.Tensor):
            if module in self.norms:
                self._track(output, _Root("norm", self.norms[module]))
            else:
                self._track(output, _Root("linear", self.linears[module]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.opaque:
            return result
        sources = [(a, self.tracked[id(a)][0]) for a in tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor) and id(a) in self.tracked]
        name = getattr(func, "__name__", repr(func))
        mutates = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        if not sources or not (mutates or any(isinstance(r, torch.Tensor) for r in tree_leaves(result))):
            return result  # untracked inputs, or a metadata read (shape, dtype, device)
        for tensor, root in sources:
            if len(sources) == 1 and isinstance(result, torch.Tensor) and _keeps_channels(
                name, args, kwargs, tensor, result, split_ok=root.kind == "linear"
            ):
                if id(result) not in self.tracked:
                    self._track(result, root)
            else:
                self.seen.uses[root.name].append(f"the op '{name}'")
        return result


def _probe_forward(model: nn.Module, norms: dict[nn.Module, str]) -> _Observations:
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise DiscoveryError(f"{type(model).__name__} has no config.vocab_size; the probe forward needs token ids")
    device = next(model.parameters()).device
    ids = (torch.arange(1, 9, device=device) * 7 % vocab).unsqueeze(0)
    was_training = model.training
    probe = _Probe(model, norms)
    model.eval()
    try:
        with torch.no_grad(), probe:
            model(input_ids=ids, use_cache=False)
    except Exception as error:  # the model's own failure, reported as what discovery needed
        raise DiscoveryError(
            f"the probe forward of {type(model).__name__} failed ({type(error).__name__}: {error}); discovery "
            "needs a decoder that runs on input_ids alone"
        ) from error
    finally:
        probe.close()
        model.train(was_training)
    return probe.seen


def _out_features(module: nn.Module) -> int:
    return module.nf if isinstance(module, Conv1D) else module.out_features


def _classify(name: str, seen: _Observations, modules: dict[str, nn.Module], size: int, is_outside: bool) -> NormSite:
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
                return NormSite(name, (producer,), "per_head")
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
    return path[len(layer_prefix):]


def _size(norm: nn.Module, style: NormStyle) -> int:
    return norm.hidden_size if isinstance(norm, TaperNorm) else TaperNorm.from_norm(norm, style).hidden_size


def discover_architecture(model: nn.Module) -> Architecture:
    """Build the table-style description of ``model``'s norms from one probe forward.

    Works on a plain or an already patched model (TaperNorms count as norms). Raises
    ``DiscoveryError`` naming the module and the reason when a norm cannot be folded.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    base = getattr(model, "base_model", model)
    prefix = next((n + "." for n, m in model.named_modules() if m is base and n), "")
    modules = dict(model.named_modules())
    norms = {m: n for n, m in modules.items() if is_norm_module(m)}
    if not norms:
        raise DiscoveryError(f"{type(model).__name__} has no RMSNorm/LayerNorm modules to replace")
    detected = {name: detect_style(module, name) for module, name in norms.items()}
    styles = {name: style for name, (style, _) in detected.items()}
    rounded = sorted({type(modules[name]).__name__ for name, (_, exact) in detected.items() if not exact})
    if rounded:
        logger.warning(
            "norm class(es) %s match the TaperNorm arithmetic only up to rounding in this dtype: at g = 1 the "
            "patched model equals the original within rounding, not bit for bit", ", ".join(rounded)
        )
    if len(set(styles.values())) > 1:
        listing = ", ".join(f"{n}: {s.value}" for n, s in styles.items())
        raise DiscoveryError(
            f"{type(model).__name__} mixes norm arithmetics ({listing}); one style per model is supported"
        )
    seen = _probe_forward(model, norms)

    # The decoder layers: the ModuleList of the base model whose items hold the norms.
    layers_of: dict[str, str] = {}
    for name in norms.values():
        parts = name[len(prefix):].split(".") if name.startswith(prefix) else []
        for cut in range(len(parts) - 1, 0, -1):
            head = ".".join(parts[:cut])
            if parts[cut].isdigit() and isinstance(base.get_submodule(head), nn.ModuleList):
                layers_of[name] = f"{prefix}{head}.{parts[cut]}."
                break
    # Every norm must be foldable on its own before the layout as a whole is checked.
    sites = {
        name: _classify(name, seen, modules, _size(module, styles[name]), name not in layers_of)
        for module, name in norms.items()
    }
    lists = {p.rsplit(".", 2)[0] for p in layers_of.values()}
    if len(lists) != 1:
        raise DiscoveryError(
            f"{type(model).__name__}: expected the norms inside one list of decoder layers, "
            f"found {sorted(lists) or 'none'}"
        )
    layers = lists.pop()[len(prefix):]
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
        per_layer[layer_prefix].append(
            NormSite(
                _relative(name, layer_prefix, name),
                tuple(_relative(c, layer_prefix, name) for c in site.consumers),
                site.kind,
            )
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
    conv1d = any(isinstance(modules[f"{first_prefix}{c}"], Conv1D) for s in layer_sites for c in s.consumers)
    return Architecture(
        model_type=model_type,
        style=next(iter(styles.values())),
        layers=layers,
        sites=layer_sites,
        final_norm=final[len(prefix):],
        lm_head=head,
        conv1d=conv1d,
    )


def architecture_of(model: nn.Module) -> Architecture:
    """The table entry for the model's type, or, when there is none, the discovered description."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in ARCHITECTURES:
        return architecture_for(model_type, config)
    try:
        arch = discover_architecture(model)
    except DiscoveryError as error:
        raise DiscoveryError(
            f"model_type '{model_type}' is not supported by hf_tapernorm; supported model types: "
            f"{', '.join(supported_model_types())}; automatic discovery refused it too: {error}"
        ) from None
    logger.info(
        "model_type '%s' has no table entry; discovered its norms automatically: %s, final norm '%s'",
        model_type,
        ", ".join(f"{s.path} -> {'/'.join(s.consumers)} ({s.kind})" for s in arch.sites),
        arch.final_norm,
    )
    return arch
