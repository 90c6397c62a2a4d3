"""The TaperNorm layer: a normalization that tapers, under one global gate, to a fixed linear map.

At gate 1 the layer computes exactly what the replaced norm computed; at gate 0 it is the per-channel
map ``c * h * taper_weight`` (plus centring and ``bias`` for the LayerNorm form), which folding then
moves into the projections that read it. All state that must survive a checkpoint (gate, c, the
calibration EMAs, the calibrated flag) lives in persistent buffers updated in place, so a resumed
run or a reloaded model needs no side channel.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from ..architectures.styles import NormStyle, effective_gain, norm_eps, norm_hidden_size, normalize
from ..errors import ConfigurationError, TaperStateError
from ..utils import in_backward_recompute


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

    ``tapered=False`` builds a layer whose gate never moves (the kept final norm of Internal-Taper, or a
    norm ``keep_norms`` keeps): it exists so the scale anchor has a place for its state and can observe
    the final norm's input, and so every norm of a patched model is handled the same way.
    """

    is_taper_norm = True  # the marker architectures.discovery recognises (it cannot import this class)

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
            raise ConfigurationError(f"ema_rate must be in (0, 1], got {ema_rate}")
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
        # Per-step sums: numerator, denominator, token count, then (with the per-channel fit) the numerator and
        # denominator of every channel. A plain attribute, not a buffer: DDP broadcasts buffers from rank 0 on
        # every forward and would overwrite other ranks' sums.
        self.pending: Optional[torch.Tensor] = None
        self.per_channel = False
        self.anchor: Optional[nn.Module] = None  # scale anchor, attached to the final norm only
        # Leading sequence positions that stay normalized at every gate (the attention-sink token of
        # a fixed BOS: its keys/values are constants of the weights, exported as a one-token KV prefix).
        # 0 = off (the paper's layer). sink_active is cleared by the model-level hook of
        # sink.set_sink_tokens for forwards that continue a cache (their first token is no sink).
        self.sink_tokens = 0
        self.sink_active = True
        self.sequence_dim = -2  # the input's sequence axis, where the sink positions are (NormSite.sequence_dim)
        # The length of the model's input in this forward (set with sink_active): a 2D input is rows of
        # [batch * seq, hidden] (OPT flattens its MLP's input), whose sink rows are every sequence_length-th.
        self.sequence_length: Optional[int] = None
        # Multiplies the calibrated c (set by patch_model): < 1 makes the linear branch conservative.
        # A token k x the typical scale runs away through gated MLPs once the gate closes; a smaller c
        # moves that threshold up, at a cost in fidelity (docs/fidelity.md).
        self.calibration_scale = 1.0

    @classmethod
    def from_norm(
        cls,
        norm: nn.Module,
        style: NormStyle,
        *,
        tapered: bool = True,
        ema_rate: float = 0.01,
        hidden_size: Optional[int] = None,
    ) -> TaperNorm:
        """Build a TaperNorm that shares ``norm``'s parameters and copies its eps (measured if it has no
        eps attribute). ``hidden_size`` is needed only for a norm with no weight and no normalized_shape."""
        size = norm_hidden_size(norm, hidden_size)
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        weight = weight if isinstance(weight, nn.Parameter) else None
        bias = bias if isinstance(bias, nn.Parameter) else None
        eps = norm_eps(norm, style, size)
        return cls(size, style=style, eps=eps, weight=weight, bias=bias, tapered=tapered, ema_rate=ema_rate)

    # ------------------------------------------------------------------ gains and gate
    def effective_gain(self) -> torch.Tensor:
        """The per-channel gain the norm applies after normalizing (``1 + w`` for Gemma)."""
        gain = effective_gain(self.style, self.weight, self.hidden_size)
        if self.weight is None and hasattr(self, "gate"):
            gain = gain.to(self.gate.device)
        return gain

    @property
    def is_calibrated(self) -> bool:
        return self._calibrated_mirror

    def set_gate(self, value: float) -> None:
        """Set this layer's gate in place (no new tensor, so compiled graphs and optimizers stay valid)."""
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise ConfigurationError(f"gate must be in [0, 1], got {value} for {self.site_name or 'TaperNorm'}")
        if not self.tapered and value != 1.0:
            raise TaperStateError(
                f"{self.site_name or 'TaperNorm'} is kept as a norm (tapered=False); its gate stays 1"
            )
        self.gate.fill_(value)
        self._phase = _phase_of(value)

    def enable_per_channel_fit(self) -> None:
        """Also gather per-channel statistics, so calibration fits ``taper_weight`` channel by channel."""
        stat = {"device": self.gate.device, "dtype": torch.float32}
        self.register_buffer("ema_num_channels", torch.zeros(self.hidden_size, **stat))
        self.register_buffer("ema_den_channels", torch.zeros(self.hidden_size, **stat))
        self.per_channel = True

    @property
    def statistics_size(self) -> int:
        return 3 + (2 * self.hidden_size if self.per_channel else 0)

    def mark_calibrated(self, c: float, channel_ratio: Optional[torch.Tensor] = None) -> None:
        """Freeze c and start the linear branch from the norm's current gain (docs/method.md, section 3).

        ``channel_ratio``: per-channel least-squares factors a_j (sum x_j^2/r over sum x_j^2); the linear
        branch then starts at ``c * taper_weight_j = a_j * gain_j``, still one per-channel map.
        """
        with torch.no_grad():
            self.c.fill_(c * self.calibration_scale)
            gain = self.effective_gain()
            if channel_ratio is not None:
                gain = gain.float() * channel_ratio.to(gain.device) / c
            self.taper_weight.copy_(gain.to(self.taper_weight.dtype))
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
        return normalize(h, self.style, self.weight, self.bias, self.eps)

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
        if sink:
            rows, dim = self._by_sequence(h)
            if rows.dim() >= -dim and rows.shape[dim] > sink:
                head, rest = rows.narrow(dim, 0, sink), rows.narrow(dim, sink, rows.shape[dim] - sink)
                return torch.cat([self._normalized(head), self._tapered(rest, phase)], dim=dim).view_as(h)
        return self._tapered(h, phase)

    def _by_sequence(self, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``h`` with its sequence axis, where the sink positions are cut: ``sequence_dim``, or, for an input that
        the model flattened to ``[batch * seq, hidden]`` rows, a ``[batch, seq, hidden]`` view of it (else every
        sequence's sink but the first would take the tapered branch)."""
        length = self.sequence_length
        if h.dim() == 2 and length and h.shape[0] % length == 0:
            return h.view(-1, length, h.shape[-1]), -2
        return h, self.sequence_dim

    def _tapered(self, h: torch.Tensor, phase: _Phase) -> torch.Tensor:
        if phase is _Phase.LINEAR:
            return self._linear(h)
        gate = self.gate.to(h.dtype)
        return gate * self._normalized(h) + (1.0 - gate) * self._linear(h)

    def _accumulate(self, h: torch.Tensor) -> None:
        sink = self.sink_tokens if self.sink_active else 0
        if sink:  # the sink stays normalized: the linear branch need not fit it
            rows, dim = self._by_sequence(h)
            if rows.dim() >= -dim and rows.shape[dim] > sink:
                h = rows.narrow(dim, sink, rows.shape[dim] - sink)
        sums = branch_statistics(
            h, self.effective_gain(), self.eps, centred=self.style is NormStyle.LAYER, per_channel=self.per_channel
        )
        if self.pending is None or self.pending.device != sums.device:
            self.pending = torch.zeros(self.statistics_size, dtype=torch.float32, device=sums.device)
        self.pending += sums

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, style={self.style.value}, eps={self.eps}, tapered={self.tapered}, "
            f"ema_rate={self.ema_rate}" + (", per_channel=True" if self.per_channel else "")
        )


#: The forward every TaperNorm must run (``refuse_replaced_forward`` compares against it).
_TAPER_FORWARD = TaperNorm.forward


def refuse_replaced_forward(model: nn.Module, where: str) -> None:
    """Refuse a model whose TaperNorms do not run ``TaperNorm.forward``.

    A kernel patch applied after ``patch_model`` (liger-kernel's ``apply_liger_kernel_to_*``, or the Trainer's
    ``use_liger_kernel=True``) binds its own forward to every norm it finds, or swaps the class's: the gate and
    the calibration statistics then never run, and calibration later fails without naming the cause. A wrapper
    that calls the original forward (``functools.wraps``, as accelerate's device hooks) is not a replacement.
    """
    for name, layer in tapered_norms(model, include_kept=True):
        forward = inspect.unwrap(layer.__dict__.get("forward", type(layer).forward))
        function = getattr(forward, "__func__", forward)
        if function is not _TAPER_FORWARD:
            owner = (
                f"{getattr(function, '__module__', None)}.{getattr(function, '__qualname__', type(function).__name__)}"
            )
            raise TaperStateError(
                f"{where}: TaperNorm {layer.site_name or name} runs {owner} instead of its own forward, so its gate "
                "and calibration statistics never run: a kernel patch (liger-kernel's apply_liger_kernel_to_*, or "
                "TrainingArguments(use_liger_kernel=True)) was applied after patch_model. Leave the norms out of it "
                "(apply_liger_kernel_to_*(rms_norm=False, layer_norm=False), or "
                "liger_kernel_config={'rms_norm': False, 'layer_norm': False})"
            )


@torch.no_grad()
def branch_statistics(
    h: torch.Tensor, gain: torch.Tensor, eps: float, *, centred: bool, per_channel: bool = False
) -> torch.Tensor:
    """Sums over tokens of ||h g||^2 / r(h) and ||h g||^2, and the token count, in fp32 (docs/method.md, section 3);
    with ``per_channel``, then the per-channel sums of x_j^2 / r(h) and of x_j^2 (shape ``3 + 2d``).

    ``centred`` selects the LayerNorm form (h - mu and sigma instead of h and the RMS).
    """
    x = h.detach().float().reshape(-1, h.shape[-1])
    if centred:
        x = x - x.mean(-1, keepdim=True)
    r = torch.sqrt(x.pow(2).mean(-1) + eps)
    energy = (x * gain.detach().float()).pow(2).sum(-1)
    count = torch.tensor(float(x.shape[0]), device=x.device)
    scalar = torch.stack([(energy / r).sum(), energy.sum(), count])
    if not per_channel:
        return scalar
    squared = x.pow(2)
    return torch.cat([scalar, (squared / r[:, None]).sum(0), squared.sum(0)])


def tapered_norms(model: nn.Module, *, include_kept: bool = False) -> Iterator[tuple[str, TaperNorm]]:
    """The TaperNorms of the model with their qualified names: those whose gate the schedule drives, and
    with ``include_kept`` also those kept as real norms (a patched model has at least one tapered norm)."""
    for name, module in model.named_modules():
        if isinstance(module, TaperNorm) and (include_kept or module.tapered):
            yield name, module


def train_tapernorm_parameters(model: nn.Module) -> list[str]:
    """Make the TaperNorms' own parameters trainable again after PEFT/LoRA froze the base model; returns their names.

    A tapered norm trains ``weight``, ``bias`` and ``taper_weight`` (its linear map adapts while the gate falls), a
    kept norm ``weight`` and ``bias``. Call it after ``get_peft_model``: without it the taper runs with every linear
    map fixed at its calibration (``TaperController`` warns). Do not list the norms in ``modules_to_save`` instead:
    PEFT then trains a copy and keeps the original, the one that runs, frozen.
    """
    names = []
    for prefix, layer in tapered_norms(model, include_kept=True):
        for attribute in ("weight", "bias", "taper_weight") if layer.tapered else ("weight", "bias"):
            parameter = getattr(layer, attribute, None)
            if isinstance(parameter, nn.Parameter):
                parameter.requires_grad_(True)
                names.append(f"{prefix}.{attribute}")
    if not names:
        raise ValueError(
            f"train_tapernorm_parameters: {type(model).__name__} has no TaperNorm; call patch_model before "
            "get_peft_model"
        )
    return names


@contextmanager
def normalized(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if every gate were 1 (each TaperNorm computes its norm), without touching the gate
    buffers: a graph built at the real gate, still waiting for its backward, stays valid."""
    layers = [layer for _, layer in tapered_norms(model)]
    phases = [layer._phase for layer in layers]
    for layer in layers:
        layer._phase = _Phase.NORM
    try:
        yield
    finally:
        for layer, phase in zip(layers, phases):
            layer._phase = phase


__all__ = [
    "TaperNorm",
    "branch_statistics",
    "normalized",
    "refuse_replaced_forward",
    "tapered_norms",
    "train_tapernorm_parameters",
]
