"""The TaperNorm layer: a normalization that tapers, under one global gate, to a fixed linear map.

At gate 1 the layer computes exactly what the replaced norm computed; at gate 0 it is the per-channel
map ``c * h * taper_weight`` (plus centring and ``bias`` for the LayerNorm form), which folding then
moves into the projections that read it. All state that must survive a checkpoint (gate, c, the
calibration EMAs, the calibrated flag) lives in persistent buffers updated in place, so a resumed
run or a reloaded model needs no side channel.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import branch_statistics, in_backward_recompute


class NormStyle(str, enum.Enum):
    """The exact arithmetic of the replaced norm (dtype handling differs between families)."""

    RMS = "rms"  # Llama family: statistics in fp32, cast back, then multiply by weight
    RMS_OFFSET = "rms_offset"  # Gemma family: fp32 throughout, multiply by (1 + weight), cast last
    LAYER = "layernorm"  # torch.nn.LayerNorm (GPT-2, OPT, NeoX, Falcon, Phi)


class _Phase(enum.Enum):
    # A Python-side mirror of the gate, so forward can skip the branch it does not need without a
    # host sync; torch.compile guards on it, so a run compiles at most three graphs.
    NORM = "norm"
    MIX = "mix"
    LINEAR = "linear"


def _phase_of(gate: float) -> _Phase:
    if gate >= 1.0:
        return _Phase.NORM
    if gate <= 0.0:
        return _Phase.LINEAR
    return _Phase.MIX


class TaperNorm(nn.Module):
    """Replacement for one RMSNorm/LayerNorm that can taper to ``c * h * taper_weight``.

    ``weight`` and ``bias`` are the replaced module's own parameters (same objects, same names), so
    checkpoint keys stay familiar and tied or shared parameters stay shared. ``taper_weight`` is the
    linear branch's per-channel gain; it is a parameter from construction so optimizers built before
    training see it, and ``calibrate`` overwrites it in place with the norm's effective gain.

    ``tapered=False`` builds a layer whose gate never moves (the kept final norm of Internal-Taper):
    it exists so the scale anchor has a place for its state and can observe the final norm's input.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        style: NormStyle,
        eps: float,
        weight: Optional[nn.Parameter],
        bias: Optional[nn.Parameter] = None,
        tapered: bool = True,
        ema_rate: float = 0.01,
    ) -> None:
        super().__init__()
        if not 0.0 < ema_rate <= 1.0:
            raise ValueError(f"ema_rate must be in (0, 1], got {ema_rate}")
        self.hidden_size = hidden_size
        self.style = NormStyle(style)
        self.eps = float(eps)
        self.tapered = tapered
        self.ema_rate = float(ema_rate)
        self.site_name = ""  # qualified name in the patched model, set by patch_model (for errors)
        reference = weight if weight is not None else bias
        factory = {
            "device": reference.device if reference is not None else None,
            "dtype": reference.dtype if reference is not None else None,
        }
        self.weight = weight
        self.bias = bias
        self.taper_weight = nn.Parameter(self.effective_gain().detach().clone().to(**factory))
        if not tapered:
            self.taper_weight.requires_grad_(False)
        stat = {"device": factory["device"], "dtype": torch.float32}
        self.register_buffer("gate", torch.ones((), **stat))
        # c in the weight dtype: a 0-d fp32 c would add a cast per norm and forward in bf16 models.
        self.register_buffer("c", torch.ones((), device=factory["device"], dtype=factory["dtype"] or torch.float32))
        self.register_buffer("ema_num", torch.zeros((), **stat))
        self.register_buffer("ema_den", torch.zeros((), **stat))
        self.register_buffer("ema_steps", torch.zeros((), dtype=torch.long, device=factory["device"]))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool, device=factory["device"]))
        self._phase = _Phase.NORM
        self._calibrated_mirror = False
        # Per-step sums (numerator, denominator, token count). A plain attribute, not a buffer:
        # DDP broadcasts buffers from rank 0 on every forward and would overwrite other ranks' sums.
        self.pending: Optional[torch.Tensor] = None
        self.anchor: Optional[nn.Module] = None  # scale anchor, attached to the final norm only
        # Leading sequence positions that stay normalized at every gate (the attention-sink token of
        # a fixed BOS: its keys/values are constants of the weights, exported as a one-token KV prefix).
        # 0 = off (the paper's layer). sink_active is cleared by the model-level hook of
        # sink.set_sink_tokens for forwards that continue a cache (their first token is no sink).
        self.sink_tokens = 0
        self.sink_active = True
        # Multiplies the calibrated c (set by patch_model): < 1 makes the linear branch conservative.
        # A token k x the typical scale runs away through the SwiGLU MLPs once the gate closes; a smaller c
        # moves that threshold up (measured on SmolLM2: 0.8 carried training from g = 0.36 to g = 0.05).
        self.calibration_scale = 1.0

    @classmethod
    def from_norm(
        cls, norm: nn.Module, style: NormStyle, *, tapered: bool = True, ema_rate: float = 0.01
    ) -> "TaperNorm":
        """Build a TaperNorm that shares ``norm``'s parameters and copies its eps."""
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        eps = next(
            (getattr(norm, a) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(norm, a)),
            None,
        )
        if eps is None:
            raise ValueError(f"cannot find the epsilon of {type(norm).__name__}; expected an 'eps' attribute")
        if weight is not None:
            hidden_size = weight.shape[-1]
        elif isinstance(norm, nn.LayerNorm):
            hidden_size = norm.normalized_shape[-1]
        else:
            raise ValueError(f"cannot infer the hidden size of {type(norm).__name__}")
        return cls(hidden_size, style=style, eps=eps, weight=weight, bias=bias, tapered=tapered, ema_rate=ema_rate)

    # ------------------------------------------------------------------ gains and gate
    def effective_gain(self) -> torch.Tensor:
        """The per-channel gain the norm applies after normalizing (``1 + w`` for Gemma)."""
        if self.weight is None:
            return torch.ones(self.hidden_size, device=self.gate.device if hasattr(self, "gate") else None)
        if self.style is NormStyle.RMS_OFFSET:
            return 1.0 + self.weight.float()
        return self.weight

    @property
    def is_calibrated(self) -> bool:
        return self._calibrated_mirror

    def set_gate(self, value: float) -> None:
        """Set this layer's gate in place (no new tensor, so compiled graphs and optimizers stay valid)."""
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"gate must be in [0, 1], got {value} for {self.site_name or 'TaperNorm'}")
        if not self.tapered and value != 1.0:
            raise ValueError(f"{self.site_name or 'TaperNorm'} is kept as a norm (tapered=False); its gate stays 1")
        self.gate.fill_(value)
        self._phase = _phase_of(value)

    def mark_calibrated(self, c: float) -> None:
        """Freeze c and start the linear branch from the norm's current gain (METHOD section 3)."""
        with torch.no_grad():
            self.c.fill_(c * self.calibration_scale)
            self.taper_weight.copy_(self.effective_gain().to(self.taper_weight.dtype))
            self.calibrated.fill_(True)
        self._calibrated_mirror = True
        self.pending = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: D401 - torch hook
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # Re-derive the Python mirrors from the loaded buffers (one sync, at load time only).
        self._phase = _phase_of(float(self.gate))
        self._calibrated_mirror = bool(self.calibrated)

    # ------------------------------------------------------------------ forward
    def _normalized(self, h: torch.Tensor) -> torch.Tensor:
        """Exactly the replaced module's arithmetic."""
        if self.style is NormStyle.LAYER:
            return F.layer_norm(h, (self.hidden_size,), self.weight, self.bias, self.eps)
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style is NormStyle.RMS_OFFSET:
            return (x * (1.0 + self.weight.float())).type_as(h)
        if self.weight is None:
            return x.to(h.dtype)
        return self.weight * x.to(h.dtype)

    def _linear(self, h: torch.Tensor) -> torch.Tensor:
        """``c * h * taper_weight``: no per-token statistic (the LN centring is itself linear)."""
        # No explicit casts: c is a 0-d fp32 buffer, which type promotion treats as a scalar, so
        # ``taper_weight * c`` stays in the weight's dtype (bf16 too) as one multiplication; a .to() is a
        # dispatcher call (a launch on GPU) per norm and token, and at g = 0 the RMS form is two products.
        scale = self.taper_weight * self.c
        if self.style is NormStyle.LAYER:
            out = (h - h.mean(-1, keepdim=True)) * scale
            return out + self.bias if self.bias is not None else out
        out = h * scale
        return out if out.dtype == h.dtype else out.to(h.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training and self.tapered and not self._calibrated_mirror and not in_backward_recompute():
            self._accumulate(h)
        if self.anchor is not None:
            self.anchor(h)
        phase = self._phase
        if phase is _Phase.NORM:
            return self._normalized(h)
        sink = self.sink_tokens if self.sink_active else 0
        if sink and h.dim() >= 2 and h.shape[-2] > sink:
            head, h = h[..., :sink, :], h[..., sink:, :]
            return torch.cat([self._normalized(head), self._tapered(h, phase)], dim=-2)
        return self._tapered(h, phase)

    def _tapered(self, h: torch.Tensor, phase: _Phase) -> torch.Tensor:
        if phase is _Phase.LINEAR:
            return self._linear(h)
        gate = self.gate.to(h.dtype)
        return gate * self._normalized(h) + (1.0 - gate) * self._linear(h)

    def _accumulate(self, h: torch.Tensor) -> None:
        if self.sink_tokens and self.sink_active and h.dim() >= 2 and h.shape[-2] > self.sink_tokens:
            h = h[..., self.sink_tokens :, :]  # the sink stays normalized: the linear branch need not fit it
        sums = branch_statistics(h, self.effective_gain(), self.eps, centred=self.style is NormStyle.LAYER)
        if self.pending is None or self.pending.device != sums.device:
            self.pending = torch.zeros(3, dtype=torch.float32, device=sums.device)
        self.pending += sums

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, style={self.style.value}, eps={self.eps}, tapered={self.tapered}, "
            f"ema_rate={self.ema_rate}"
        )
