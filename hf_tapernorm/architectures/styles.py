"""The arithmetic of the norms hf_tapernorm replaces, and how to read a norm module's eps and size.

Three arithmetics cover the families transformers ships; they differ in dtype handling, which is
why TaperNorm must reproduce each exactly (docs/method.md, section 1). A norm module that does not expose
its eps (OLMo's parameter-free LayerNorm hard-codes it) has it measured from one forward.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError

EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
#: The eps values models use; a measured eps within 2% of one of them is taken to be it.
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12, 1e-7, 1e-9, 1e-10)


class NormStyle(str, enum.Enum):
    """The exact arithmetic of the replaced norm (dtype handling differs between families)."""

    RMS = "rms"  # Llama family: statistics in fp32, cast back, then multiply by weight
    RMS_OFFSET = "rms_offset"  # Gemma family: fp32 throughout, multiply by (1 + weight), cast last
    LAYER = "layernorm"  # torch.nn.LayerNorm (GPT-2, OPT, NeoX, Falcon, Phi)


def normalize(
    h: torch.Tensor, style: NormStyle, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """What a norm of ``style`` computes on ``h``, bit for bit as the family's own module does."""
    if style is NormStyle.LAYER:
        return F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if style is NormStyle.RMS_OFFSET:
        gain = 1.0 + weight.float() if weight is not None else 1.0
        return (x * gain).type_as(h)
    if weight is None:
        return x.to(h.dtype)
    return weight * x.to(h.dtype)


def effective_gain(style: NormStyle, weight: Optional[torch.Tensor], size: int) -> torch.Tensor:
    """The per-channel gain applied after normalizing (``1 + w`` for Gemma, ones without a weight)."""
    if weight is None:
        return torch.ones(size)
    if style is NormStyle.RMS_OFFSET:
        return 1.0 + weight.float()
    return weight


def norm_hidden_size(norm: nn.Module, default: Optional[int] = None) -> int:
    """The channel count a norm normalizes: its weight's size, ``normalized_shape``, or ``default``."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[-1])
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return int(shape[-1]) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    if default is not None:
        return int(default)
    raise UnsupportedModelError(
        f"cannot infer the hidden size of {type(norm).__name__}: it has no weight and no normalized_shape"
    )


def norm_eps(norm: nn.Module, style: NormStyle, size: int) -> float:
    """The norm's eps: its attribute when it has one, otherwise measured from one small-scale forward."""
    for attribute in EPS_ATTRIBUTES:
        value = getattr(norm, attribute, None)
        if isinstance(value, (int, float)):
            return float(value)
    return _measured_eps(norm, style, size)


@torch.no_grad()
def _measured_eps(norm: nn.Module, style: NormStyle, size: int) -> float:
    """Solve ``y = g x / sqrt(s^2 + eps)`` for eps on rows of known scale s (LN: centred, minus the bias).

    The row scale s is lowered until eps is a sizeable part of s^2 + eps, so fp32 rounding cannot hide it.
    """
    reference = next(iter(norm.parameters()), None)
    dtype, device = torch.float32, reference.device if reference is not None else None
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    gain = effective_gain(style, weight, size).detach().float().to(device)
    signs = torch.ones(size, device=device)
    signs[1::2] = -1.0  # mean 0 and variance s^2 for an even size; the LN form centres it anyway
    shift = bias.detach().float() if style is NormStyle.LAYER and bias is not None else 0.0
    estimate = float("nan")
    for scale in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        x = (scale * signs).to(dtype)[None]
        if style is NormStyle.LAYER:
            x = x - x.mean(-1, keepdim=True)
        squared = float(x.pow(2).mean())
        y = norm(x.to(reference.dtype) if reference is not None else x).float()[0] - shift
        usable = (gain.abs() > 1e-6) & (x[0].abs() > 0)
        if not bool(usable.any()):
            break
        ratio = (y[usable] / (gain[usable] * x[0][usable])).double().median()
        estimate = float(1.0 / ratio.pow(2)) - squared
        if estimate > 0.1 * squared:  # eps is well resolved at this scale
            break
    if not estimate > 0:
        raise UnsupportedModelError(
            f"cannot determine the eps of {type(norm).__name__}: it has no {'/'.join(EPS_ATTRIBUTES)} attribute and "
            "its output on small inputs does not reveal one; give the class an 'eps' attribute"
        )
    return next((value for value in COMMON_EPS if abs(estimate / value - 1.0) < 0.02), estimate)


__all__ = ["NormStyle", "effective_gain", "norm_eps", "norm_hidden_size", "normalize"]
