"""What an experiment adds to a ``taper`` run, passed in rather than patched in.

A research arm (conversion_scripts/experiments/) that needs one more loss term, callback or way of feeding the
training blocks runs the whole ``taper`` pipeline, with its run folder, report and ``--resume``, by handing
``run_taper`` (or ``hf_tapernorm.cli.main.main(..., extension=)``) a :class:`TaperExtension`. The pipeline's own
tables (``training_run.LOG_KEYS``, ``LOSS_TERM_KEYS``) are read-only; an extension's keys join them for its run
only. The normalized baseline trains without the extension's callbacks and terms, but on its training data: the
gap between the two then measures the taper, not the data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional

from transformers import TrainerCallback

from ..config import ExperimentalOptions, TaperNormConfig
from ..data.corpus import PackedData
from ..training.callback import TaperCallback
from .record import global_batch_blocks


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class TrainingInputs:
    """What a ``training_data`` hook reads: the run's packed blocks and the options that shaped them.

    ``packed.train`` holds ``max_steps`` optimizer steps of ``blocks_per_step`` blocks of ``data.block_size``
    tokens, each starting with ``packed.prefix_ids`` (the sink), in the order of the corpus; ``data`` and
    ``training`` are the command's data arguments and TrainingArguments (``seed``, ``data_seed``, ``max_steps``),
    ``model_config`` the model's transformers config (its positions, for a check).
    """

    packed: PackedData
    data: Any
    training: Any
    tokenizer: Any
    model_config: Any

    @property
    def blocks_per_step(self) -> int:
        """Blocks per optimizer step over every process (per device x accumulation x processes)."""
        return global_batch_blocks(self.training)


@dataclass(frozen=True)
class TrainingData:
    """What the Trainer reads, as a ``training_data`` hook builds it (the tapered run and its baseline alike).

    ``dataset``: a ``datasets.Dataset`` (the Trainer shuffles it) or a torch ``IterableDataset`` (read in order),
    of examples with ``input_ids`` and ``labels`` and optionally ``attention_mask`` and ``position_ids`` (the
    distillation's teacher reads the positions the student reads). ``facts`` join the report's ``data`` section,
    over the pipeline's own where they name the same key (``train_blocks``, say). ``tokens(steps)``: the tokens the
    first ``steps`` optimizer steps read, when that is not steps x blocks per step x block size.
    """

    dataset: Any
    facts: Mapping[str, Any] = field(default_factory=_empty)
    tokens: Optional[Callable[[int], int]] = None


@dataclass(frozen=True)
class TaperExtension:
    """Extra parts of one ``taper`` run.

    ``taper_callback`` builds the run's TaperCallback from the keyword arguments the pipeline passes
    (``allow_changes``, ``trust_sharded_checkpoint``): a subclass (``functools.partial`` for its own
    options) can attach a loss term with ``hf_tapernorm.layers.add_training_loss_term`` at
    ``on_train_begin``. ``callbacks`` train after it (tapered run only). ``log_keys`` maps the training
    log's keys to the report's history keys; ``loss_terms`` names those history keys that are loss terms
    added to the cross-entropy (the report's ``ce`` leaves them out).

    ``training_data`` builds what both trainings read from the packed blocks (:class:`TrainingInputs` ->
    :class:`TrainingData`); it runs before the weights load and before the run folder is touched, so a
    ``ConfigurationError`` it raises refuses the run in one line. ``data_facts`` are its options: they join the
    run's identity (its ``data`` section, which ``--resume`` and ``--baseline_from`` compare, so a run with other
    values is another run) and the report's ``data`` section.

    ``experimental`` sets the recipe's experimental options (``ExperimentalOptions`` fields, which ``taper`` has
    no flag for) in the tapered run's config: they join its identity and its report like any option.
    """

    taper_callback: Callable[..., TaperCallback] = TaperCallback
    callbacks: tuple[TrainerCallback, ...] = ()
    log_keys: Mapping[str, str] = field(default_factory=_empty)
    loss_terms: tuple[str, ...] = ()
    training_data: Optional[Callable[[TrainingInputs], TrainingData]] = None
    data_facts: Mapping[str, Any] = field(default_factory=_empty)
    experimental: Mapping[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        ExperimentalOptions.check_values(**self.experimental)  # a bad name or value: refused before the run
        unknown = sorted(set(self.loss_terms) - set(self.log_keys.values()))
        if unknown:
            raise ValueError(f"TaperExtension: loss_terms {unknown} are not report keys of log_keys")
        if self.data_facts and self.training_data is None:
            raise ValueError("TaperExtension: data_facts describe a training_data hook, and there is none")

    def recipe(self, config: TaperNormConfig) -> TaperNormConfig:
        """The tapered run's config: the command's, with the extension's experimental options."""
        return config.replace(experimental=self.experimental) if self.experimental else config

    def build_training_data(self, inputs: TrainingInputs) -> TrainingData:
        """The hook's training data, or the packed blocks as they are."""
        if self.training_data is None:
            return TrainingData(inputs.packed.train)
        return self.training_data(inputs)


__all__ = ["TaperExtension", "TrainingData", "TrainingInputs"]
