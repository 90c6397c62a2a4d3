"""The robustness scan: does the folded model break on any window of text, at any offset and any length?

A tapered model can match its normalized reference on average and still break outright on a rare input:
without the norm in front of attention, a grown residual draws attention away from the constant sink key,
which grows the residual further, and past some token every prediction is worse than chance
(docs/fidelity.md). Blocks cut at fixed boundaries, at the training length, sample that poorly. The scan
reads windows that start at arbitrary token offsets of each evaluation text (the sink first, as in
training), at the training block length and at 2x, 4x and 8x it (up to the model's positions), scores the
model and its reference (the normalized baseline, or the original) on the same tokens, and calls a window
**broken** when some stretch of it as long as a training block loses more than ``threshold`` nats per token
against the reference. A long window is judged by its worst stretch, not its mean: a break late in a
1024-token window would otherwise be diluted by the tokens before it.

Every length reads about the same number of tokens (``windows`` at the training length, half as many at
twice it, and so on, at least :data:`MIN_WINDOWS`), so the scan's cost is ``len(lengths)`` times that of
``windows`` blocks per text and model. Windows are drawn with a fixed seed from the text alone: every run of
a comparison, whatever its training seed, reads the same windows, and a report's windows can be read again
from their offsets.

For the worst windows the scan also reads the share of attention each layer gives the first position (the
sink) in both models, and names the first layer where the model's share falls below half the reference's:
where the runaway takes hold.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ..data.heldout import EvaluationSet
from .scores import BROKEN_BLOCK_NATS, score_models

logger = logging.getLogger(__name__)

#: The scan's result in an export folder (written by the CLI's export, read by ``push``).
SCAN_FILE = "robustness_scan.json"
#: Window lengths, as multiples of the training block length.
LENGTH_MULTIPLES = (1, 2, 4, 8)
#: Fewest windows read at any length.
MIN_WINDOWS = 2
#: How many of the worst windows the result lists (with their text and sink-attention shares).
WORST_SHOWN = 10
#: Text tokens of a window shown in the worst-window table.
FIRST_TOKENS_SHOWN = 16
#: Query positions before this one are left out of a layer's sink share (the first few attend anywhere).
SINK_SHARE_FROM = 8
#: A layer "loses the sink" where the model's share is below this fraction of the reference's...
SINK_SHARE_FALL = 0.5
#: ...and the reference's share is at least this (a layer that barely uses the sink cannot lose it).
SINK_SHARE_MIN = 0.1


def scan_lengths(block_size: int, max_positions: Optional[int]) -> list[int]:
    """The window lengths (sink included): the training length and its multiples, up to the model's positions."""
    lengths = [block_size * m for m in LENGTH_MULTIPLES]
    return [n for n in lengths if max_positions is None or n <= max_positions]


def window_counts(windows: int, lengths: Sequence[int]) -> dict[int, int]:
    """Windows per length: ``windows`` at the first length, as many tokens at each longer one."""
    first = lengths[0]
    return {n: max(MIN_WINDOWS, round(windows * first / n)) for n in lengths}


def draw_offsets(stream_length: int, span: int, count: int, seed: int) -> torch.Tensor:
    """``count`` start offsets (sorted, distinct where the stream allows) of ``span``-token windows of a stream."""
    room = stream_length - span + 1
    if room < 1:
        return torch.empty(0, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    if room <= count:
        return torch.arange(room)
    return torch.randperm(room, generator=generator)[:count].sort().values


@dataclass
class ScanRow:
    """One text at one length."""

    text: str
    length: int
    windows: int
    tokens: int
    model_loss: float
    reference_loss: float
    broken: int
    gap_without_broken: Optional[float]
    #: 90% interval of the gap over resamples of the windows: a gap read on a few windows is rough, and says so
    gap_interval: Optional[tuple[float, float]] = None

    @property
    def gap(self) -> float:
        return self.model_loss / self.reference_loss - 1.0 if self.reference_loss else float("nan")


@dataclass
class ScanWindow:
    """One window, as the worst-window table shows it."""

    text: str
    length: int
    offset: int
    document: str
    worst_excess: float  # nats per token over the reference, on the window's worst stretch
    model_loss: float
    reference_loss: float
    first_tokens: str
    sink_share: dict[str, Any] = field(default_factory=dict)  # per-layer shares and the layer where it falls


@dataclass
class ScanResult:
    """What the scan found; ``to_dict`` is what reports and exports store (``robustness_scan`` key/file)."""

    reference: str
    threshold_nats: float
    stretch_tokens: int
    seed: int
    rows: list[ScanRow]
    worst: list[ScanWindow]

    @property
    def broken(self) -> int:
        return sum(row.broken for row in self.rows)

    @property
    def windows(self) -> int:
        return sum(row.windows for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, source in zip(data["rows"], self.rows):
            row["gap"] = source.gap
        data.update(broken=self.broken, windows=self.windows)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScanResult:
        rows = []
        for row in data["rows"]:
            fields = {k: v for k, v in row.items() if k != "gap"}
            if fields.get("gap_interval") is not None:  # JSON holds the pair as a list
                fields["gap_interval"] = tuple(fields["gap_interval"])
            rows.append(ScanRow(**fields))
        worst = [ScanWindow(**window) for window in data["worst"]]
        return cls(data["reference"], data["threshold_nats"], data["stretch_tokens"], data["seed"], rows, worst)


#: Resamples of the windows behind a row's gap interval, and the interval's coverage.
GAP_RESAMPLES = 2000
GAP_COVERAGE = 0.9


def gap_interval(model_ce: torch.Tensor, reference_ce: torch.Tensor, seed: int = 0) -> Optional[tuple[float, float]]:
    """A bootstrap interval of the relative gap over windows (rows of ``[windows, targets]`` losses).

    Windows, not tokens, are resampled: the tokens of one window are not independent draws of the text, and a
    gap carried by one unusual window should read as uncertain. None for a single window.
    """
    if model_ce.shape[0] < 2:
        return None
    mine, theirs = model_ce.double().sum(1), reference_ce.double().sum(1)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(mine), (GAP_RESAMPLES, len(mine)), generator=generator)
    gaps = mine[picks].sum(1) / theirs[picks].sum(1) - 1
    tail = (1 - GAP_COVERAGE) / 2
    low, high = torch.quantile(gaps, torch.tensor([tail, 1 - tail], dtype=gaps.dtype)).tolist()
    return (low, high)


def _worst_stretch(excess: torch.Tensor, stretch: int) -> torch.Tensor:
    """Per row of ``[n, targets]`` per-token excess loss, the largest mean over ``stretch`` consecutive targets."""
    stretch = min(stretch, excess.shape[1])
    sums = torch.nn.functional.pad(excess.double().cumsum(dim=1), (1, 0))
    return ((sums[:, stretch:] - sums[:, :-stretch]) / stretch).max(dim=1).values


@dataclass
class _Scored:
    """One scored window, before the worst ones are chosen."""

    worst_excess: float
    text: EvaluationSet
    length: int
    offset: int
    ids: torch.Tensor
    model_ce: torch.Tensor
    reference_ce: torch.Tensor


def robustness_scan(
    model: nn.Module,
    reference: nn.Module,
    texts: Sequence[EvaluationSet],
    *,
    block_size: int,
    windows: int,
    max_positions: Optional[int],
    tokenizer: Any = None,
    reference_name: str = "baseline",
    seed: int = 0,
    batch_tokens: Optional[int] = None,
    threshold: float = BROKEN_BLOCK_NATS,
) -> ScanResult:
    """Scan ``model`` against ``reference`` on every text of ``texts`` (each with its token ``stream``).

    ``block_size`` is the training block length (sink included), the first window length and the stretch a
    broken window is judged on. ``batch_tokens`` bounds the tokens of one forward (default: 8 blocks).
    """
    lengths = scan_lengths(block_size, max_positions)
    if windows < 1 or not lengths:
        raise ValueError("robustness_scan needs windows >= 1 and a block size within the model's positions")
    counts = window_counts(windows, lengths)
    models = {"model": model, "reference": reference}
    rows, scored = [], []
    for text_index, text in enumerate(texts):
        if text.stream is None:
            raise ValueError(f"the {text.name} set holds no token stream to draw scan windows from")
        for length in lengths:
            offsets = draw_offsets(
                len(text.stream), length - text.prefix_length, counts[length], seed + 7919 * text_index + length
            )
            if len(offsets) == 0:
                logger.info("scan: the %s text is shorter than one window of %d tokens", text.name, length)
                continue
            row, windows_scored = _scan_length(
                models, text, length, offsets, block_size, batch_tokens or 8 * block_size, threshold
            )
            rows.append(row)
            scored.extend(windows_scored)
    scored.sort(key=lambda window: window.worst_excess, reverse=True)
    worst = [_shown(window, models, tokenizer, threshold) for window in scored[:WORST_SHOWN]]
    return ScanResult(reference_name, threshold, block_size, seed, rows, worst)


def _scan_length(
    models: Mapping[str, nn.Module],
    text: EvaluationSet,
    length: int,
    offsets: torch.Tensor,
    block_size: int,
    batch_tokens: int,
    threshold: float,
) -> tuple[ScanRow, list[_Scored]]:
    """Both models on the windows of one text at one length: its row, and every window's scores."""
    span = length - text.prefix_length
    prefix = text.blocks[0, : text.prefix_length]
    ids = torch.cat([prefix.expand(len(offsets), -1), text.stream[offsets[:, None] + torch.arange(span)]], dim=1)
    scores = score_models(
        models,
        ids,
        prefix_length=text.prefix_length,
        batch_size=max(1, batch_tokens // length),
        desc=f"scan {text.name}, {length} tokens",
        where="robustness_scan",
    )
    model_ce, reference_ce = scores["model"].cross_entropy, scores["reference"].cross_entropy
    worst = _worst_stretch(model_ce - reference_ce, block_size - text.prefix_length - 1)
    kept = worst <= threshold
    gap_without = float(model_ce[kept].double().mean() / reference_ce[kept].double().mean() - 1) if kept.any() else None
    row = ScanRow(
        text.name,
        length,
        len(offsets),
        int(model_ce.numel()),
        float(model_ce.double().mean()),
        float(reference_ce.double().mean()),
        int((~kept).sum()),
        gap_without,
        gap_interval(model_ce, reference_ce),
    )
    windows = [
        _Scored(float(worst[i]), text, length, int(offsets[i]), ids[i], model_ce[i], reference_ce[i])
        for i in range(len(offsets))
    ]
    return row, windows


def _shown(window: _Scored, models: Mapping[str, nn.Module], tokenizer: Any, threshold: float) -> ScanWindow:
    """A worst window as the result lists it: its document, first tokens and (if broken) where the sink is lost."""
    text = window.text
    document = text.documents[int(text.stream_documents[window.offset])] if text.stream_documents is not None else ""
    first = window.ids[text.prefix_length : text.prefix_length + FIRST_TOKENS_SHOWN].tolist()
    broken = window.worst_excess > threshold
    return ScanWindow(
        text.name,
        window.length,
        window.offset,
        document,
        window.worst_excess,
        float(window.model_ce.double().mean()),
        float(window.reference_ce.double().mean()),
        tokenizer.decode(first) if tokenizer is not None else " ".join(map(str, first)),
        sink_share_fall(models["model"], models["reference"], window.ids[None]) if broken else {},
    )


# ----------------------------------------------------------------------------- attention to the sink
def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each layer's attention module: the outermost modules whose class name ends in ``Attention``."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return [module for _, module in found]


@torch.no_grad()
def sink_shares(model: nn.Module, ids: torch.Tensor) -> list[float]:
    """Per layer, the mean share of attention on key position 0 (the sink), over heads and the query positions
    from :data:`SINK_SHARE_FROM` on. Runs one forward in eager attention (the implementation is restored)."""
    shares: list[float] = []

    def record(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(weights, torch.Tensor) and weights.dim() == 4:
            queries = max(1, weights.shape[2] - SINK_SHARE_FROM)
            shares.append(float(weights[:, :, -queries:, 0].double().mean()))

    previous = model.config._attn_implementation  # transformers exposes the setter only (set_attn_implementation)
    handles = [module.register_forward_hook(record) for module in _attention_modules(model)]
    try:
        model.set_attn_implementation("eager")
        model.eval()(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return shares


def sink_share_fall(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Both models' per-layer sink shares on ``ids`` and the first layer where the model's share falls below
    :data:`SINK_SHARE_FALL` of the reference's (None if none does, or the shares cannot be read)."""
    try:
        mine, theirs = sink_shares(model, ids), sink_shares(reference, ids)
    except Exception as error:  # noqa: BLE001 - a diagnostic: an architecture without eager weights skips it
        logger.info("scan: sink shares not read (%s: %s)", type(error).__name__, error)
        return {}
    if not mine or len(mine) != len(theirs):
        return {}
    fall = next(
        (layer for layer, (a, b) in enumerate(zip(mine, theirs)) if b >= SINK_SHARE_MIN and a < SINK_SHARE_FALL * b),
        None,
    )
    return {"model": [round(s, 4) for s in mine], "reference": [round(s, 4) for s in theirs], "falls_at_layer": fall}


# ----------------------------------------------------------------------------- words
def scan_line(scan: Mapping[str, Any], where: str = "") -> Optional[str]:
    """One line for the end of a command when the folded model breaks on the scan (None when it does not)."""
    if not scan or not scan.get("broken"):
        return None
    by_length: dict[int, int] = {}
    for row in scan["rows"]:
        by_length[row["length"]] = by_length.get(row["length"], 0) + row["broken"]
    lengths = ", ".join(f"{n} at {length} tokens" for length, n in sorted(by_length.items()) if n)
    return (
        f"WARNING: the folded model breaks on {scan['broken']} of {scan['windows']} scanned windows ({lengths}: more "
        f"than {scan['threshold_nats']:g} nats per token worse than the {scan['reference']})"
        + (f"; they are listed in {where}" if where else "")
    )


def scan_summary(scan: Mapping[str, Any]) -> str:
    """The scan's result in one sentence (report summary, model card, push)."""
    if not scan:
        return "not scanned"
    texts = sorted({row["text"] for row in scan["rows"]})
    lengths = sorted({row["length"] for row in scan["rows"]})
    return (
        f"{scan['broken']} broken of {scan['windows']} windows ({', '.join(texts)}; lengths "
        f"{', '.join(map(str, lengths))} tokens; broken: more than {scan['threshold_nats']:g} nats per token worse "
        f"than the {scan['reference']} on a stretch of {scan['stretch_tokens']} tokens)"
    )


__all__ = [
    "LENGTH_MULTIPLES",
    "SCAN_FILE",
    "ScanResult",
    "ScanRow",
    "ScanWindow",
    "draw_offsets",
    "gap_interval",
    "robustness_scan",
    "scan_lengths",
    "scan_line",
    "scan_summary",
    "sink_share_fall",
    "sink_shares",
    "window_counts",
]
