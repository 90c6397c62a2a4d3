"""The fold check: the folded model's logits against the unfolded g = 0 model's, on a probe batch.

Folding reorders products (``W (c x)`` becomes ``(W c) x``), so in low precision the two models differ by
rounding; on inputs where a g = 0 model is chaotic that rounding is amplified. A failed check below
float64 is therefore repeated on a float64 copy, folded again: if that agrees, the fold itself is exact.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from ..errors import ConfigurationError, FoldCheckError
from ..layers.sink import sink_token_ids_of
from ..utils import parameter_count

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 2e-2}


@dataclass(frozen=True)
class FoldReport:
    """Result of the built-in check: logits of the folded vs the unfolded g = 0 model on a probe batch.

    ``max_rel_diff`` is ``max |folded - unfolded| / max |unfolded|`` (relative to the logit scale;
    an element-wise ratio is meaningless near zero logits).
    """

    max_abs_diff: float
    max_rel_diff: float
    tolerance: float
    dtype: str
    probe_shape: tuple[int, ...]
    #: Set when the check in ``dtype`` failed and was repeated on float64 copies, which passed: the
    #: fold is exact and the difference is this model's own amplification of rounding on the probe.
    float64_max_rel_diff: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)


def check_probe(model: nn.Module, probe: Any) -> None:
    """Refuse a probe the model cannot read (before the fold): a batch of token ids, (batch, tokens), inside the
    vocabulary; the embedding would otherwise fail with an index or dtype error after the work."""
    if probe is None:
        return
    vocab = model.get_input_embeddings().weight.shape[0]
    valid = isinstance(probe, torch.Tensor) and probe.dim() == 2 and probe.numel() > 0
    valid = valid and not probe.is_floating_point() and not probe.is_complex() and probe.dtype is not torch.bool
    if not valid or int(probe.min()) < 0 or int(probe.max()) >= vocab:
        shape = tuple(probe.shape) if isinstance(probe, torch.Tensor) else type(probe).__name__
        raise ConfigurationError(
            f"fold_model: probe must be a (batch, tokens) tensor of token ids in [0, {vocab}), got {shape}"
            + (f" {probe.dtype}" if isinstance(probe, torch.Tensor) else "")
        )


def _probe_batch(model: nn.Module, probe: Optional[torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    if probe is not None:
        return probe.to(device)
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (2, 32), generator=generator).to(device)


@torch.no_grad()
def check_fold(
    unfolded: nn.Module,
    folded: nn.Module,
    *,
    probe: Optional[torch.Tensor] = None,
    tolerance: Optional[float] = None,
    refold: Optional[Callable[[nn.Module], nn.Module]] = None,
) -> FoldReport:
    """Compare the logits of ``folded`` and the unfolded g = 0 model on a probe batch; raise above tolerance.

    With a sink prefix both models read ``sink + probe`` (the folded one holds the sink's keys/values and
    takes the leading sink for them); the logits of the probe positions are compared. When the check
    fails at the default tolerance below float64 and ``refold`` (how ``folded`` was made) is given, a
    float64 copy of the unfolded model is folded again and compared: if those agree (to
    FLOAT64_RECHECK_TOLERANCE, or to a thousandth of the float32 difference: FLOAT64_SHRINK), the fold is
    exact and the difference is the model's own amplification of rounding (a g = 0 model on the edge of a
    runaway), which is logged as a warning instead of raised. An explicit ``tolerance`` is strict.
    """
    ids = _probe_batch(unfolded, probe)
    dtype = folded.dtype
    explicit_tolerance = tolerance
    tolerance = DEFAULT_TOLERANCE.get(dtype, 1e-4) if tolerance is None else float(tolerance)
    max_abs, max_rel, finite = _logit_difference(unfolded, folded, ids)
    report = FoldReport(max_abs, max_rel, tolerance, str(dtype).removeprefix("torch."), tuple(ids.shape))
    if finite and max_rel <= tolerance:
        return report
    message = (
        f"the folded model's logits differ from the unfolded g = 0 model's: max abs {max_abs:.3g}, "
        f"max relative {max_rel:.3g} > tolerance {tolerance:.3g} ({report.dtype}, probe {report.probe_shape})"
    )
    exact = None
    # Under autocast the float64 copies would run in the autocast dtype too: their agreement would prove nothing.
    autocast = torch.is_autocast_enabled(ids.device.type)
    if finite and dtype != torch.float64 and refold is not None and explicit_tolerance is None and not autocast:
        exact = _float64_difference(unfolded, refold, ids)
    if autocast:
        message += "; autocast is on around the check: fold and check with autocast disabled"
    if exact is None or exact > max(FLOAT64_RECHECK_TOLERANCE, FLOAT64_SHRINK * max_rel):
        detail = f"; in float64 it is {exact:.3g}, so the fold itself is wrong" if exact is not None else ""
        raise FoldCheckError(f"{message}{detail}; pass a larger tolerance only if this dtype's rounding explains it")
    # Folding reorders products (W (c x) becomes (W c) x). On inputs where the g = 0 model is chaotic (a
    # token whose scale runs away), that rounding difference is amplified like any other: not a fold error.
    logger.warning(
        "%s, but a float64 copy folds to within %.3g: the fold is exact, and on this probe the g = 0 model amplifies "
        "%s rounding into that difference, so its outputs there are not reliable in %s either; check its fidelity",
        message,
        exact,
        report.dtype,
        report.dtype,
    )
    return replace(report, float64_max_rel_diff=exact)


#: Largest model whose fold check is repeated on float64 copies (two copies of 8 bytes per parameter).
FLOAT64_RECHECK_MAX_PARAMETERS = 2_000_000_000
#: Relative logit difference of the float64 copies below which the fold counts as exact. Not 1e-8:
#: HF norms compute their statistics in float32 even in a float64 model (a few 1e-8), while a
#: wrong fold differs by 1e-2 and more.
FLOAT64_RECHECK_TOLERANCE = 1e-6

#: A float64 difference at most this fraction of the float32 one also counts as exact. On a probe where the
#: g = 0 model runs away, even the float64 copies differ by more than FLOAT64_RECHECK_TOLERANCE: the float32
#: statistics of HF norms round the two copies' inputs apart here and there, and the model amplifies that
#: like any rounding. Rounding shrinks with precision and a fold error does not: a wrong fold differs as
#: much in float64 as in float32.
FLOAT64_SHRINK = 1e-3


def _logit_difference(unfolded: nn.Module, folded: nn.Module, ids: torch.Tensor) -> tuple[float, float, bool]:
    """Max abs and relative logit difference on ``ids`` (the unfolded model reads the sink first), and finiteness.

    With a sink prefix both read ``sink + ids``: the folded model's leading sink stands for its stored one.
    """
    sink = torch.tensor(sink_token_ids_of(unfolded), dtype=ids.dtype, device=ids.device)
    modes = unfolded.training, folded.training
    unfolded.eval(), folded.eval()
    try:
        with_sink = torch.cat([sink[None].expand(ids.shape[0], -1), ids], dim=1)
        reference = unfolded(input_ids=with_sink, use_cache=False).logits[:, len(sink) :].to(torch.float64)
        # The folded model reads the same sink-first ids (unambiguous even when the sink id also occurs in text).
        output = folded(input_ids=with_sink, use_cache=False).logits[:, len(sink) :].to(torch.float64)
    finally:
        unfolded.train(modes[0]), folded.train(modes[1])
    max_abs = float((output - reference).abs().max())
    max_rel = max_abs / max(float(reference.abs().max()), torch.finfo(torch.float64).tiny)
    return max_abs, max_rel, bool(torch.isfinite(output).all())


def _float64_difference(
    unfolded: nn.Module, refold: Callable[[nn.Module], nn.Module], ids: torch.Tensor
) -> Optional[float]:
    """Relative logit difference between a float64 copy of ``unfolded`` and its fold (None: model too large).

    The copy is folded again in float64: upcasting the low-precision fold would keep its rounding.
    """
    if parameter_count(unfolded) > FLOAT64_RECHECK_MAX_PARAMETERS:
        return None
    unfolded64 = copy.deepcopy(unfolded).to(torch.float64)
    return _logit_difference(unfolded64, refold(unfolded64), ids)[1]


__all__ = ["DEFAULT_TOLERANCE", "FoldReport", "check_fold"]
