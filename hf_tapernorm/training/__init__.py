"""Training: the gate schedule, calibration, distillation, the divergence watch, and the two drivers
(``TaperController`` for any loop, ``TaperCallback`` for the Trainer). Depends on layers/ and below.

The public names beyond the drivers and checkpoints (which the top level exports too):

- :class:`TaperSchedule` (schedule.py): the gate as a function of the optimizer step;
- :func:`calibrate`, :func:`update_statistics`, :func:`calibration_table` (calibration.py): the linear
  branch's c from the warmup's statistics (for a loop that drives the gate itself), and a per-layer table;
- :class:`Distillation`, :func:`distillation_loss` (distillation.py): the KL term to a frozen teacher;
- :class:`DivergenceThresholds` (divergence.py): when a run counts as diverged
  (``TaperCallback(thresholds=...)``);
- :func:`place_first` (callback.py): put the Trainer's TaperCallback before its reporting callbacks;
  :func:`add_to_training_log`: add keys to a training log from ``on_log`` (and to ``trainer_state.json``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "TaperSchedule": "schedule",
    "calibrate": "calibration",
    "update_statistics": "calibration",
    "calibration_table": "calibration",
    "distillation_loss": "distillation",
    "Distillation": "distillation",
    "DivergenceThresholds": "divergence",
    "TaperController": "controller",
    "TaperCallback": "callback",
    "place_first": "callback",
    "add_to_training_log": "callback",
    "save_tapered": "checkpoints",
    "load_tapered": "checkpoints",
    "save_sharded_checkpoint": "sharded",
    "load_sharded_checkpoint": "sharded",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .calibration import calibrate, calibration_table, update_statistics
    from .callback import TaperCallback, add_to_training_log, place_first
    from .checkpoints import load_tapered, save_tapered
    from .controller import TaperController
    from .distillation import Distillation, distillation_loss
    from .divergence import DivergenceThresholds
    from .schedule import TaperSchedule
    from .sharded import load_sharded_checkpoint, save_sharded_checkpoint
