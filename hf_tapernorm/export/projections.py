"""The float64 algebra of folding: working copies of the projections, and what one norm site does to them.

``fold_model`` (a tapered norm at g = 0: its whole linear map; a kept pre-norm: its weight) and
``flashnorm_model`` (every pre-norm's weight) share it, so a FlashNorm fold and an export's weightless
norms are the same arithmetic. Every product is taken in float64 on working copies (a projection that
absorbs two norms is folded exactly) and cast once to each weight's own dtype; Conv1D ([in, out])
weights are transposed into nn.Linear layout and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ..architectures.sites import Site
from ..architectures.styles import NormStyle, effective_gain, norm_eps, norm_hidden_size
from ..errors import UnsupportedModelError


class WorkingProjection:
    """A float64 working copy of one projection in nn.Linear layout ([out, in])."""

    def __init__(self, module: nn.Module, path: str) -> None:
        if isinstance(module, nn.Linear):
            self.transposed = False
        elif isinstance(module, Conv1D):
            self.transposed = True
        else:
            raise UnsupportedModelError(
                f"cannot fold into {path}: {type(module).__name__} is neither nn.Linear nor Conv1D"
            )
        weight = module.weight.detach()
        if not weight.is_floating_point():
            raise UnsupportedModelError(
                f"cannot fold into {path}: its weight is {weight.dtype} (a quantized model?); load the model in a "
                "floating dtype, fold, then quantize the folded model"
            )
        self.weight = (weight.t() if self.transposed else weight).to(torch.float64).clone()
        self.bias = module.bias.detach().to(torch.float64).clone() if module.bias is not None else None
        self.had_bias = module.bias is not None
        self.weight_dtype = module.weight.dtype
        self.bias_dtype = module.bias.dtype if module.bias is not None else module.weight.dtype

    def fold_input(self, scale: torch.Tensor, beta: Optional[torch.Tensor], centred: bool) -> None:
        """The projection reads ``(h - mu) * scale + beta`` (or ``h * scale``): W' = W A, b' = b + W beta."""
        if beta is not None:
            shift = self.weight @ beta
            self.bias = shift if self.bias is None else self.bias + shift
        self.weight = self.weight * scale[None, :]
        if centred:
            self.weight = self.weight - self.weight.mean(dim=1, keepdim=True)

    def fold_output(self, scale: torch.Tensor, beta: Optional[torch.Tensor], centred: bool) -> None:
        """The projection's output, in groups of ``len(scale)`` rows, is normalized at g = 0 then scaled."""
        group = scale.numel()
        out_features = self.weight.shape[0]
        if out_features % group:
            raise UnsupportedModelError(f"cannot fold a norm of size {group} into {out_features} output rows")
        rows = self.weight.view(out_features // group, group, -1)
        bias = self.bias.view(-1, group) if self.bias is not None else None
        if centred:
            rows = rows - rows.mean(dim=1, keepdim=True)
            bias = bias - bias.mean(dim=1, keepdim=True) if bias is not None else None
        self.weight = (rows * scale[None, :, None]).reshape(out_features, -1)
        if bias is not None:
            bias = bias * scale[None, :]
        if beta is not None:
            bias = beta[None, :].expand(out_features // group, group) + (bias if bias is not None else 0.0)
        self.bias = bias.reshape(-1) if bias is not None else None

    def tensors(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        weight = self.weight.t() if self.transposed else self.weight
        bias = self.bias.to(self.bias_dtype) if self.bias is not None else None
        return weight.to(self.weight_dtype).contiguous(), bias


@dataclass
class FoldState:
    """What folding the norm sites produced: the folded model's state dict and the structure its config records."""

    state: dict[str, torch.Tensor]
    folded_norms: list[str] = field(default_factory=list)
    kept_norms: list[str] = field(default_factory=list)
    weightless_norms: dict[str, float] = field(default_factory=dict)  # kept norms whose weight folded: path -> eps
    scaled_norms: list[str] = field(default_factory=list)
    added_biases: list[str] = field(default_factory=list)
    head_choice: Optional[str] = None  # the tied-head policy applied, when a folding final norm met tied embeddings
    projections: int = 0


def fold_into(
    model: PreTrainedModel, working: dict[str, WorkingProjection], site: Site, scale, beta, centred: bool
) -> None:
    """Fold one site's per-channel map into the modules the table names for it (consumers or producer)."""
    for path in site.modules:
        if path not in working:
            working[path] = WorkingProjection(model.get_submodule(path), path)
        if site.kind == "input":
            working[path].fold_input(scale, beta, centred)
        else:
            working[path].fold_output(scale, beta, centred)


def make_weightless(
    model: PreTrainedModel, fold: FoldState, working: dict, site: Site, norm: nn.Module, style: NormStyle
) -> None:
    """FlashNorm at one pre-norm: its consumers absorb its gain (``1 + w`` for Gemma) and, for a LayerNorm, its
    bias (W' = W diag(gain), b' = b + W beta, in float64); the norm stays, weightless, with its own eps."""
    weight, bias = (getattr(norm, name, None) for name in ("weight", "bias"))
    size = norm_hidden_size(norm)
    reference = weight if weight is not None else bias
    gain = effective_gain(style, weight, size).detach().to(reference.device, torch.float64)
    beta = bias.detach().to(torch.float64) if style is NormStyle.LAYER and bias is not None else None
    for key in [k for k in fold.state if k.startswith(site.path + ".")]:
        del fold.state[key]
    fold.weightless_norms[site.path] = norm_eps(norm, style, size)
    fold_into(model, working, site, gain, beta, centred=False)


def store_projections(fold: FoldState, working: dict) -> None:
    """The folded projections' weights (and biases, noting the new ones) into the folded state dict."""
    for path, work in working.items():
        weight, bias = work.tensors()
        fold.state[f"{path}.weight"] = weight
        if bias is not None:
            fold.state[f"{path}.bias"] = bias
            if not work.had_bias:
                fold.added_biases.append(path)
    fold.projections = len(working)


__all__ = ["FoldState", "WorkingProjection", "fold_into", "make_weightless", "store_projections"]
