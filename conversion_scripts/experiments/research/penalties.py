"""Token-scale penalties: research regularisers that did not let a pretrained model lose its gated-MLP norms.

Kept for the experiments that measured them (docs/fidelity.md); lower API promise than the stable package.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hf_tapernorm import ConfigurationError, TaperStateError
from hf_tapernorm.layers import (
    ForwardInputs,
    TaperNorm,
    add_training_loss_term,
    in_backward_recompute,
    remove_training_loss_term,
)


class TokenScalePenalty:
    """Penalise tokens whose residual scale exceeds ``ratio`` x the median token, at every tapered norm.

    Once the gate closes, a token k times larger than the typical one reaches attention and the MLP
    k times too large (and the MLP's output grows about as k^2), so outlier tokens run away. The
    penalty ``weight * mean_layers mean_tokens relu(log r(h) - log(ratio * median r))^2`` teaches the
    model uniform token scales while the norms still hide them (start it at gate 1). The median is
    per layer and per forward, detached; the first ``sink_tokens`` positions (kept normalized) are
    exempt. Install once; add ``penalty()`` to the loss after each forward.
    """

    def __init__(self, model: nn.Module, *, weight: float = 0.01, ratio: float = 4.0, sink_tokens: int = 0) -> None:
        if weight < 0 or ratio < 1:
            raise ConfigurationError(f"TokenScalePenalty needs weight >= 0 and ratio >= 1, got {weight} and {ratio}")
        self.weight = float(weight)
        self.log_ratio = math.log(ratio)
        self.sink_tokens = int(sink_tokens)
        self._terms: list[torch.Tensor] = []
        layers = [m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered]
        if not layers:
            raise TaperStateError(f"{type(model).__name__} has no tapered TaperNorm layers; call patch_model first")
        self._handles = [layer.register_forward_pre_hook(self._observe) for layer in layers]
        self._layers = len(layers)

    def _token_log_scales(self, layer: TaperNorm, args: tuple) -> Optional[torch.Tensor]:
        """Per non-sink token, log RMS of the layer's input; None outside counted training forwards."""
        if not layer.training or self.weight == 0 or in_backward_recompute():
            return None
        x = args[0]
        if self.sink_tokens:
            x = x[..., self.sink_tokens :, :]
        return 0.5 * torch.log(x.float().pow(2).mean(-1) + layer.eps).reshape(-1)

    def _observe(self, layer: TaperNorm, args: tuple) -> None:
        log_r = self._token_log_scales(layer, args)
        if log_r is None:
            return
        excess = F.relu(log_r - log_r.detach().median() - self.log_ratio)
        self._terms.append(excess.pow(2).mean())

    def attach(self, model: nn.Module) -> TokenScalePenalty:
        """Add the penalty to ``outputs.loss`` of every training forward of ``model`` (for ``Trainer``).

        Under gradient accumulation the penalty is weighted by the micro-batch's share of the step's
        labels, like the cross-entropy.
        """
        self._model = model
        add_training_loss_term(model, "token_scale_penalty", self._loss_term)
        return self

    def _loss_term(self, model: nn.Module, inputs: ForwardInputs, output: Any):
        value = self()
        count = inputs.label_count
        if count is None:
            return value, torch.ones((), device=value.device)
        return value.to(count.device) * count, count

    def __call__(self) -> torch.Tensor:
        """The penalty of the forwards since the last call (0 when none), and reset."""
        if not self._terms:
            return torch.zeros(())
        value = self.weight * torch.stack(self._terms).sum() / self._layers
        self._terms = []
        return value

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self, "_model", None) is not None:
            remove_training_loss_term(self._model, "token_scale_penalty")
            self._model = None


class ScaleGrowthPenalty(TokenScalePenalty):
    """Penalise tokens whose scale, relative to the median token, grows from one tapered norm to the next.

    The runaway that breaks a tapering pretrained model (``conversion_scripts/experiments/runaway_trace.py``)
    is a token slightly above the typical scale whose excess grows sublayer after sublayer once the norms
    stop bounding it, then squares through the SwiGLU MLPs (docs/fidelity.md). A norm makes every sublayer
    contract such excesses; this penalty,
    ``weight * mean_pairs mean_tokens relu(d_next - d)^2`` over the tokens with ``d > log(ratio)``,
    where ``d`` is a token's log RMS minus the median's at a tapered norm's input and the pairs are
    consecutive tapered norms in forward order, teaches the sublayers to keep contracting while the
    gate closes. It is near 0 for a normalized model and grows as the gate falls, on exactly the
    tokens that are about to run away. The sink positions are exempt.
    """

    def __init__(self, model: nn.Module, *, weight: float = 1.0, ratio: float = 1.0, sink_tokens: int = 0) -> None:
        super().__init__(model, weight=weight, ratio=ratio, sink_tokens=sink_tokens)
        self._first = next(m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered)

    def _observe(self, layer: TaperNorm, args: tuple) -> None:
        log_r = self._token_log_scales(layer, args)
        if log_r is None:
            return
        if layer is self._first or not self._terms:
            self._terms.append([])  # a new forward starts at the first tapered norm
        self._terms[-1].append(log_r - log_r.detach().median())

    def __call__(self) -> torch.Tensor:
        """The penalty of the forwards since the last call (0 when none), and reset."""
        forwards, self._terms = self._terms, []
        pairs = [
            F.relu(after - before).pow(2).mul(before.detach() > self.log_ratio).mean()
            for deviations in forwards
            for before, after in zip(deviations, deviations[1:])
        ]
        if not pairs:
            return torch.zeros(())
        return self.weight * torch.stack(pairs).sum() / max(1, self._layers - 1)


__all__ = ["ScaleGrowthPenalty", "TokenScalePenalty"]
