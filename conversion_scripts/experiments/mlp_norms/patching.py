"""The one place these experiments call ``hf_tapernorm.patch_model``, with the published recipe's knobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from hf_tapernorm import TaperNormConfig, patch_model


def patch(
    model,
    *,
    scope: str = "internal",
    keep_norms: Sequence[str] = (),
    sink_token_ids: Optional[Sequence[int]] = None,
    scale_loss_weight: float = 0.1,
    relative_scale_loss: bool = True,
    ema_rate: float = 0.01,
):
    """Replace the model's norms by TaperNorm (gate 1, outputs unchanged), in place; returns the model."""
    config = TaperNormConfig.paper(
        scope=scope,
        keep_norms=list(keep_norms),
        sink_token_ids=list(sink_token_ids) if sink_token_ids else None,
        scale_loss_weight=scale_loss_weight,
        relative_scale_loss=relative_scale_loss,
        ema_rate=ema_rate,
    )
    return patch_model(model, config)


__all__ = ["patch"]
