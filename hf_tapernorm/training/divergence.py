"""The divergence watch: stop a taper that breaks the model before more steps are paid for.

Divergence is a normal outcome when a pretrained model loses its norms (docs/fidelity.md). Three
signals, each read once per optimizer step:

- the residual scale entering the final norm, against the frozen scale target (a runaway token lifts
  the mean scale by orders of magnitude, but only late);
- the model's own loss (cross-entropy, without the scale loss or distillation), against the running
  median of the recent steps;
- the gradient norm (when the loop reports it), against its running median.

A spike is a step whose value exceeds ``spike_ratio`` (loss) or ``grad_spike_ratio`` (gradient norm)
times the running median of the last ``history`` ordinary steps; ``spike_steps`` consecutive spikes stop
the run. A lone bad batch (one hard document) does not: it must persist. Spikes do not enter the
history, so a diverging run cannot raise its own reference. Non-finite values stop the run at once.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigurationError, TaperDivergenceError


@dataclass(frozen=True)
class DivergenceThresholds:
    """When the watch stops a run (module docstring). Every ratio must be > 1."""

    max_scale_ratio: float = 100.0
    spike_ratio: float = 3.0
    grad_spike_ratio: float = 100.0
    spike_steps: int = 3
    history: int = 20
    min_history: int = 5

    def __post_init__(self) -> None:
        for name in ("max_scale_ratio", "spike_ratio", "grad_spike_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 1):
                raise ConfigurationError(f"DivergenceThresholds.{name} must be > 1, got {value!r}")
        for name in ("spike_steps", "history", "min_history"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigurationError(f"DivergenceThresholds.{name} must be an int >= 1, got {value!r}")
        if self.min_history > self.history:
            raise ConfigurationError(
                f"DivergenceThresholds.min_history ({self.min_history}) cannot exceed history ({self.history})"
            )


def divergence_thresholds(
    thresholds: Optional[DivergenceThresholds], max_scale_ratio: Optional[float], who: str
) -> DivergenceThresholds:
    """The thresholds ``who`` (TaperCallback, TaperController) watches by: ``thresholds``, else the defaults with
    ``max_scale_ratio`` (its shortcut). Checked when ``who`` is built: a dict of the same fields was taken as given
    and failed at the first watched step with an AttributeError that named no option."""
    if thresholds is None:
        return DivergenceThresholds(**({"max_scale_ratio": max_scale_ratio} if max_scale_ratio is not None else {}))
    if not isinstance(thresholds, DivergenceThresholds):
        shown = f"a {type(thresholds).__name__}"
        raise ConfigurationError(
            f"{who}: thresholds must be a DivergenceThresholds, got {shown}"
            + (f": write DivergenceThresholds(**{thresholds!r})" if isinstance(thresholds, dict) else "")
        )
    if max_scale_ratio is not None:
        raise ConfigurationError("pass max_scale_ratio inside thresholds=DivergenceThresholds(...), not both")
    return thresholds


@dataclass
class SpikeDetector:
    """Consecutive-spike counter of one signal against the running median of its ordinary values."""

    name: str
    ratio: float
    thresholds: DivergenceThresholds
    values: deque = field(default_factory=deque)
    consecutive: int = 0

    def observe(self, value: float) -> Optional[str]:
        """Record ``value``; a message when the run must stop, else None."""
        if not math.isfinite(value):
            return f"the {self.name} is not finite ({value})"
        level = statistics.median(self.values) if len(self.values) >= self.thresholds.min_history else None
        if level is not None and level > 0 and value > self.ratio * level:
            self.consecutive += 1
            if self.consecutive >= self.thresholds.spike_steps:
                return (
                    f"the {self.name} has been above {self.ratio:g}x its running median ({level:.4g}) for "
                    f"{self.consecutive} consecutive steps (now {value:.4g})"
                )
            return None
        self.consecutive = 0
        self.values.append(value)
        while len(self.values) > self.thresholds.history:
            self.values.popleft()
        return None


class DivergenceWatch:
    """The three signals of one run; :meth:`check` raises :class:`TaperDivergenceError` with the reason."""

    def __init__(self, thresholds: Optional[DivergenceThresholds] = None) -> None:
        self.thresholds = thresholds or DivergenceThresholds()
        self.loss = SpikeDetector("training loss", self.thresholds.spike_ratio, self.thresholds)
        self.grad_norm = SpikeDetector("gradient norm", self.thresholds.grad_spike_ratio, self.thresholds)

    def check(
        self,
        where: str,
        *,
        loss: Optional[float] = None,
        grad_norm: Optional[float] = None,
        scales: tuple[tuple[str, float, Optional[float]], ...] = (),
        culprit: str = "",
    ) -> None:
        """``scales``: (site, mean residual scale, frozen target or None) per anchored norm."""
        reasons = []
        for site, scale, target in scales:
            if not math.isfinite(scale):
                reasons.append(f"the residual scale entering {site} is not finite")
            elif target is not None and scale > self.thresholds.max_scale_ratio * target:
                reasons.append(
                    f"the residual scale entering {site} is {scale:.4g}, {scale / target:.1f}x its target "
                    f"{target:.4g} (limit {self.thresholds.max_scale_ratio:g}x)"
                )
        if loss is not None:
            reasons.append(self.loss.observe(float(loss)))
        if grad_norm is not None:
            reasons.append(self.grad_norm.observe(float(grad_norm)))
        reasons = [r for r in reasons if r]
        if reasons:
            raise TaperDivergenceError(f"training diverged {where}: {'; '.join(reasons)}. {culprit}".rstrip())


__all__ = ["DivergenceThresholds", "DivergenceWatch", "SpikeDetector", "divergence_thresholds"]
