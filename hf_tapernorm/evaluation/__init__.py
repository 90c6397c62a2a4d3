"""Scoring models on text: the models to score, their losses, and the robustness scan.

A library tier above export/ (it opens tapered checkpoints and folded exports) and data/ (it scores their
blocks), used by the ``taper`` and ``eval`` commands and by the research scripts:

- :class:`ModelSource`, :func:`resolve_model`, :func:`load_model`, :func:`load_tokenizer`,
  :func:`embedded_model` (models.py): any model the package takes (a Hub id, a folder, a GGUF file, the
  embedded SmolLM2, a tapered checkpoint, a folded export), resolved before anything loads;
- :func:`evaluate_set`, :func:`heldout_loss`, :func:`score_models`, :func:`broken_blocks`, :func:`per_document`,
  :class:`Scores`, :data:`BROKEN_BLOCK_NATS` (scores.py): cross-entropy per block and per document, and the
  blocks where a model is broken (worse than chance over a stretch);
- :func:`robustness_scan`, :func:`draw_offsets`, :func:`scan_lengths`, :func:`sink_shares`, :func:`gap_interval`
  (scan.py): windows at any offset of a text, at 1x to 8x the training length, against a reference model, and how
  rough a gap read on a few windows is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "ModelSource": "models",
    "embedded_model": "models",
    "load_model": "models",
    "load_tokenizer": "models",
    "resolve_model": "models",
    "BROKEN_BLOCK_NATS": "scores",
    "Scores": "scores",
    "broken_blocks": "scores",
    "evaluate_set": "scores",
    "heldout_loss": "scores",
    "per_document": "scores",
    "score_models": "scores",
    "draw_offsets": "scan",
    "gap_interval": "scan",
    "robustness_scan": "scan",
    "scan_lengths": "scan",
    "sink_shares": "scan",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .models import ModelSource, embedded_model, load_model, load_tokenizer, resolve_model
    from .scan import draw_offsets, gap_interval, robustness_scan, scan_lengths, sink_shares
    from .scores import BROKEN_BLOCK_NATS, Scores, broken_blocks, evaluate_set, heldout_loss, per_document, score_models
