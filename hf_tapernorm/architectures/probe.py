"""The probe forward of discovery: follow every norm's output (and input) through the ops that read it.

One short forward under a ``TorchFunctionMode`` with module hooks records, per norm, which linear
projections read its output, which other ops touch it, and which projection produced its input.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from transformers.pytorch_utils import Conv1D

from ..errors import UnsupportedModelError

LINEAR_TYPES = (nn.Linear, Conv1D)
# Ops through which a tensor keeps its channels (last dimension) in place; they pass tracking on.
_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach", "dropout"}
#: Tokens of the probe forward; a norm input's sequence axis is the one of this length.
PROBE_LENGTH = 8

_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}
_TRANSPOSES = {"transpose", "swapaxes", "permute"}


@dataclass
class _Root:
    """Where a tracked tensor comes from: a norm's output or a linear projection's output."""

    kind: str  # "norm" | "linear"
    name: str


@dataclass
class Observations:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    consumers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # norm -> linears
    uses: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # root -> other readers
    norm_inputs: dict[str, list[Optional[str]]] = field(default_factory=lambda: defaultdict(list))  # norm -> producer
    readers_of_linear: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # linear -> norms
    sizes: dict[str, int] = field(default_factory=dict)  # norm -> channels of its input (parameter-free norms)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # norm -> shape of its first input
    # root -> (the module whose own forward ran the op, the op) for each op in ``uses`` ("": the top level)
    op_sites: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))


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
        self.linears = {m: n for n, m in model.named_modules() if isinstance(m, LINEAR_TYPES)}
        self.seen = Observations()
        self.tracked: dict[int, tuple[_Root, torch.Tensor]] = {}  # strong refs: ids are never reused
        self.opaque = 0  # > 0 inside a norm or a linear: their own arithmetic is not a "use"
        self.running: list[str] = []  # the modules whose forward is under way, outermost first
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(lambda *_, name=name: self.running.append(name)))
            self.handles.append(module.register_forward_hook(self._done, always_call=True))
        for module in set(norms) | set(self.linears):
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _done(self, *_: Any) -> None:
        """A module's forward ended (a forward hook: it returns None, so the output stays as it is)."""
        self.running.pop()

    def _track(self, tensor: torch.Tensor, root: _Root) -> None:
        self.tracked[id(tensor)] = (root, tensor)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.opaque == 0:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            source = self.tracked.get(id(tensors[0]), (None, None))[0] if tensors else None
            if module in self.norms:
                name = self.norms[module]
                self.seen.calls[name] += 1
                if tensors and tensors[0].dim() > 0:
                    self.seen.sizes.setdefault(name, int(tensors[0].shape[-1]))
                    self.seen.shapes.setdefault(name, tuple(tensors[0].shape))
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
        sources = [
            (a, self.tracked[id(a)][0])
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and id(a) in self.tracked
        ]
        name = getattr(func, "__name__", repr(func))
        mutates = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        if not sources or not (mutates or any(isinstance(r, torch.Tensor) for r in tree_leaves(result))):
            return result  # untracked inputs, or a metadata read (shape, dtype, device)
        for tensor, root in sources:
            if (
                len(sources) == 1
                and isinstance(result, torch.Tensor)
                and _keeps_channels(name, args, kwargs, tensor, result, split_ok=root.kind == "linear")
            ):
                if id(result) not in self.tracked:
                    self._track(result, root)
            else:
                self.seen.uses[root.name].append(f"the op '{name}'")
                self.seen.op_sites[root.name].append((self.running[-1] if self.running else "", name))
        return result


def probe_forward(model: nn.Module, norms: dict[nn.Module, str]) -> Observations:
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no config.vocab_size; the probe forward needs token ids"
        )
    device = next(model.parameters()).device
    ids = (torch.arange(1, PROBE_LENGTH + 1, device=device) * 7 % vocab).unsqueeze(0)
    was_training = model.training
    probe = _Probe(model, norms)
    model.eval()
    try:
        with torch.no_grad(), probe:
            model(input_ids=ids, use_cache=False)
    except Exception as error:  # the model's own failure, reported as what discovery needed
        raise UnsupportedModelError(
            f"the probe forward of {type(model).__name__} failed ({type(error).__name__}: {error}); discovery "
            "needs a decoder that runs on input_ids alone"
        ) from error
    finally:
        probe.close()
        model.train(was_training)
    return probe.seen


__all__ = ["LINEAR_TYPES", "Observations", "probe_forward"]
