"""What an experiment adds to a ``taper`` run, passed in rather than patched in.

A research arm (conversion_scripts/experiments/) that needs one more loss term or callback runs the whole
``taper`` pipeline, with its run folder, report and ``--resume``, by handing ``run_taper`` (or
``hf_tapernorm.cli.main.main(..., extension=)``) a :class:`TaperExtension`. The pipeline's own tables
(``training_run.LOG_KEYS``, ``LOSS_TERM_KEYS``) are read-only; an extension's keys join them for its run
only, and the normalized baseline trains without the extension.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from transformers import TrainerCallback

from ..training.callback import TaperCallback


@dataclass(frozen=True)
class TaperExtension:
    """Extra training parts of one ``taper`` run.

    ``taper_callback`` builds the run's TaperCallback from the keyword arguments the pipeline passes
    (``allow_changes``, ``trust_sharded_checkpoint``): a subclass (``functools.partial`` for its own
    options) can attach a loss term with ``hf_tapernorm.layers.add_training_loss_term`` at
    ``on_train_begin``. ``callbacks`` train after it (tapered run only). ``log_keys`` maps the training
    log's keys to the report's history keys; ``loss_terms`` names those history keys that are loss terms
    added to the cross-entropy (the report's ``ce`` leaves them out).
    """

    taper_callback: Callable[..., TaperCallback] = TaperCallback
    callbacks: tuple[TrainerCallback, ...] = ()
    log_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    loss_terms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.loss_terms) - set(self.log_keys.values()))
        if unknown:
            raise ValueError(f"TaperExtension: loss_terms {unknown} are not report keys of log_keys")


__all__ = ["TaperExtension"]
