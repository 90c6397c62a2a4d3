"""The gate schedule (docs/method.md, section 2): a pure function of the optimizer step.

Steps are counted from 1: step k is the k-th optimizer update, the one that runs while the
Trainer's ``state.global_step == k - 1``. The gate is exactly 1 up to and including ``k_start``
(those steps gather the calibration statistics), follows a half cosine in between, and is exactly
0.0 from ``k_end`` on. Because the gate depends on the step alone, a resumed run needs no schedule
state: the step number is enough.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

from transformers import SchedulerType, get_scheduler
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

from ..config import Step, TaperNormConfig, check_step
from ..errors import ConfigurationError
from ..utils import true_or_false

logger = logging.getLogger(__name__)

#: Our default for continued pretraining (docs/method.md, section 2): calibrate over the first 5% of the
#: run, reach g = 0 at 70%, and train the remaining 30% at g = 0 (TaperNormConfig's defaults).
CONTINUED_PRETRAINING = (TaperNormConfig.taper_start, TaperNormConfig.taper_end)


@dataclass(frozen=True)
class TaperSchedule:
    """Cosine taper from g = 1 to g = 0 between optimizer steps ``k_start`` and ``k_end``.

    ``k_start``/``k_end`` are absolute optimizer steps (int) or fractions of the run (float in
    (0, 1]), resolved against the run length with :meth:`resolve` (the Trainer's ``max_steps``).
    ``allow_incomplete=True`` turns "the gate does not reach 0 before the run ends" from an error
    into a warning, for runs that deliberately stop mid-taper.
    """

    k_start: Step = CONTINUED_PRETRAINING[0]
    k_end: Step = CONTINUED_PRETRAINING[1]
    total_steps: Optional[int] = None
    allow_incomplete: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "allow_incomplete", true_or_false(self.allow_incomplete, "TaperSchedule.allow_incomplete")
        )
        check_step("TaperSchedule.k_start", self.k_start)
        check_step("TaperSchedule.k_end", self.k_end)
        if self.total_steps is not None:
            _check_total_steps(self.total_steps)
            total = self.total_steps
            for name in ("k_start", "k_end"):  # fractions become absolute steps of this run
                value = getattr(self, name)
                if isinstance(value, float):
                    object.__setattr__(self, name, int(round(value * total)))
            self._validate()

    @classmethod
    def from_config(cls, config: TaperNormConfig, **overrides) -> TaperSchedule:
        """The schedule of a TaperNormConfig's taper window."""
        return cls(config.taper_start, config.taper_end, **overrides)

    # ------------------------------------------------------------------ resolution
    def steps_for(self, total_steps: int) -> tuple[int, int]:
        """(k_start, k_end) as optimizer steps of a run of ``total_steps``, without validating them."""
        return tuple(int(round(v * total_steps)) if isinstance(v, float) else v for v in (self.k_start, self.k_end))

    def resolve(self, total_steps: int) -> TaperSchedule:
        """The same schedule with absolute steps for a run of ``total_steps`` optimizer steps."""
        if self.total_steps is not None and self.total_steps != total_steps:
            raise ConfigurationError(
                f"TaperSchedule was built for total_steps={self.total_steps}, but the run has {total_steps} "
                "optimizer steps; build it without total_steps to resolve fractions against the run"
            )
        return replace(self, total_steps=total_steps)

    def _validate(self) -> None:
        start, end, total = self.k_start, self.k_end, self.total_steps
        described = f"k_start={start}, k_end={end}, total_steps={total}"
        if start < 1:
            raise ConfigurationError(
                f"TaperSchedule({described}): k_start must be >= 1, so calibration sees at least one optimizer "
                "step of statistics at g = 1 (a fraction of a short run can round to 0: give more steps or an int)"
            )
        if end <= start:
            raise ConfigurationError(f"TaperSchedule({described}): k_end must be greater than k_start")
        if end > total:
            message = (
                f"TaperSchedule({described}): the gate reaches 0 only at step {end}, after the run's last "
                f"step {total}; it ends at g = {self.gate(total):.4f}, so the model cannot be folded. Lower "
                "k_end, train longer, or pass allow_incomplete=True to stop mid-taper on purpose"
            )
            if not self.allow_incomplete:
                raise ConfigurationError(message)
            logger.warning(message)

    # ------------------------------------------------------------------ the gate
    def gate(self, step: int) -> float:
        """The gate of optimizer step ``step`` (counted from 1): 1 until k_start, exactly 0.0 from k_end."""
        if isinstance(self.k_start, float) or isinstance(self.k_end, float):
            raise ConfigurationError(
                f"TaperSchedule(k_start={self.k_start}, k_end={self.k_end}) has fractional steps; "
                "call .resolve(total_steps) first"
            )
        if step <= self.k_start:
            return 1.0
        if step >= self.k_end:
            return 0.0
        progress = (step - self.k_start) / (self.k_end - self.k_start)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_total_steps(total: object) -> None:
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ConfigurationError(f"total_steps must be a positive int, got {total!r}")


def fit_default_window(
    taper_start: Step,
    taper_end: Step,
    total_steps: int,
    *,
    start_set: Optional[bool] = None,
    end_set: Optional[bool] = None,
) -> tuple[Step, Step]:
    """The taper window a run of ``total_steps`` uses: an end of the window left to the recipe whose fraction rounds
    to step 0 (the start), or to a step at or before the start (the end), moves to the nearest step that works
    (start at step 1, end one step after it), so the default window fits every run of 2 steps or more, in the CLI
    and the library alike. An end the caller set is left as it is (TaperSchedule names what is wrong with it).

    ``start_set``/``end_set``: whether the caller chose that end (the CLI: its flag was given). None tells by value:
    an end at TaperNormConfig's default (CONTINUED_PRETRAINING) is the recipe's. A config cannot tell its default
    from the same value given, and moving 5% of a 10-step run to step 1 is what either asks for.
    """
    _check_total_steps(total_steps)
    if total_steps < 2:  # TaperSchedule would blame the window fitted to it, which the caller may never have set
        raise ConfigurationError(
            f"a taper needs a run of at least 2 optimizer steps (one at g = 1 to calibrate, one at g = 0), got "
            f"total_steps={total_steps}"
        )
    start_set = taper_start != CONTINUED_PRETRAINING[0] if start_set is None else start_set
    end_set = taper_end != CONTINUED_PRETRAINING[1] if end_set is None else end_set
    k_start, k_end = TaperSchedule(taper_start, taper_end).steps_for(total_steps)
    if not start_set and k_start < 1:
        taper_start = k_start = 1
    if not end_set and k_end <= k_start < total_steps:
        taper_end = k_start + 1
    return taper_start, taper_end


class WrittenDecayKwargs(dict):
    """The ``lr_scheduler_kwargs`` that decay_learning_rate_after_the_taper writes: a dict (the scheduler, to_dict and
    json read it as one) that carries the num_decay_steps it wrote and the run length it was computed for. The mark
    travels with the dict, so a copy of the arguments (``dataclasses.replace``, ``copy.deepcopy``, a pickle) still
    tells the written value from a user's, where a mark on the arguments was lost and the copy's value read as the
    user's.

    Built from the pairs alone, as ``dataclasses.asdict`` and ``astuple`` copy a dict (``str(args)`` and ``repr(args)``
    call asdict), it is a copy of a written value: its num_decay_steps is the mark, its run length unknown."""

    def __init__(
        self,
        kwargs: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        decay_steps: Optional[int] = None,
        run_length: Optional[int] = None,
    ) -> None:
        super().__init__(kwargs)
        if decay_steps is not None:
            self["num_decay_steps"] = decay_steps
        elif isinstance(kwargs, WrittenDecayKwargs):  # type(kw)(kw): the same mark
            decay_steps, run_length = kwargs.decay_steps, kwargs.run_length
        else:
            decay_steps = self.get("num_decay_steps")
        self.decay_steps, self.run_length = decay_steps, run_length


def decay_learning_rate_after_the_taper(args, schedule: TaperSchedule) -> None:
    """With ``lr_scheduler_type="warmup_stable_decay"`` and no ``num_decay_steps``, decay once the gate is 0.

    The learning rate then stays up while the gate falls, and the model has decaying steps left at g = 0
    to repair what the taper changed (docs/fidelity.md). An explicit ``num_decay_steps`` is left alone. The
    arguments get a new kwargs dict (the user's is never changed in place), a WrittenDecayKwargs: one
    TrainingArguments shared by two Trainers (or copied) gets each its own window's, not the first one's read as
    the user's.
    """
    if not decay_steps_missing(args):
        return
    written = WrittenDecayKwargs(users_scheduler_kwargs(args), decay_steps_of(schedule), schedule.total_steps)
    args.lr_scheduler_kwargs = written
    logger.info(
        "the learning rate decays over the %d steps after the gate reaches 0 (step %d)",
        written.decay_steps,
        schedule.k_end,
    )


def decay_steps_of(schedule: TaperSchedule) -> int:
    """The num_decay_steps of a resolved schedule: the steps after the gate reaches 0 (at least 1)."""
    return max(1, schedule.total_steps - schedule.k_end)


def written_decay_steps(args) -> Optional[int]:
    """The num_decay_steps of ``args.lr_scheduler_kwargs`` where decay_learning_rate_after_the_taper wrote it (for
    this run, an earlier one sharing the arguments, or the arguments these were copied from), unchanged since; None
    where the user set it, or nobody did."""
    kwargs = getattr(args, "lr_scheduler_kwargs", None)
    if not isinstance(kwargs, WrittenDecayKwargs) or kwargs.get("num_decay_steps") != kwargs.decay_steps:
        return None
    return kwargs.decay_steps


def written_decay_run_length(args) -> Optional[int]:
    """The max_steps that the num_decay_steps of written_decay_steps was computed for (None where there is none)."""
    return args.lr_scheduler_kwargs.run_length if written_decay_steps(args) is not None else None


def users_scheduler_kwargs(args) -> dict[str, Any]:
    """``args.lr_scheduler_kwargs`` as the user gave them: without the num_decay_steps that
    decay_learning_rate_after_the_taper wrote (for an earlier Trainer's window, where the arguments are shared)."""
    kwargs = getattr(args, "lr_scheduler_kwargs", None)
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    if written_decay_steps(args) is not None:  # ours, unchanged since
        return {key: item for key, item in kwargs.items() if key != "num_decay_steps"}
    return kwargs


def decay_steps_missing(args) -> bool:
    """Whether the run is a ``warmup_stable_decay`` one whose user set neither num_decay_steps nor num_stable_steps:
    the decay is then the taper's to place (decay_learning_rate_after_the_taper)."""
    kwargs = users_scheduler_kwargs(args)
    return _warmup_stable_decay(args) and "num_decay_steps" not in kwargs and "num_stable_steps" not in kwargs


def stable_steps_without_decay(args) -> bool:
    """Whether the run is a ``warmup_stable_decay`` one whose user set num_stable_steps and no num_decay_steps, which
    transformers' get_wsd_schedule always needs (a TypeError from train() otherwise)."""
    kwargs = users_scheduler_kwargs(args)
    return _warmup_stable_decay(args) and "num_stable_steps" in kwargs and "num_decay_steps" not in kwargs


def _warmup_stable_decay(args) -> bool:
    """Whether ``args`` train with the ``warmup_stable_decay`` scheduler (its name, or the SchedulerType)."""
    kind = getattr(args, "lr_scheduler_type", None)
    return getattr(kind, "value", kind) == "warmup_stable_decay"


def forget_written_decay(args) -> None:
    """Give ``args`` back the user's scheduler kwargs, without a num_decay_steps written for another run."""
    if written_decay_steps(args) is not None:
        args.lr_scheduler_kwargs = users_scheduler_kwargs(args)


#: Why the Trainer's own arguments of the scheduler are no keys of --lr_scheduler_kwargs: the Trainer passes
#: get_scheduler's itself, and a fresh run's scheduler starts at step 0 (the checkpoint's step, on --resume).
_SET_BY_THE_TRAINER = {
    "optimizer": "the optimizer it builds",
    "num_warmup_steps": "from --warmup_steps",
    "num_training_steps": "from --max_steps",
    "last_epoch": "the scheduler's step count, which a fresh run starts at 0 and --resume restores",
}


def checked_scheduler_kwargs(args) -> dict[str, Any]:
    """The --lr_scheduler_kwargs the Trainer hands its scheduler ({} for none), each key one the --lr_scheduler_type's
    function takes and the Trainer does not set itself; any other is refused in one line (ConfigurationError).

    Read from the functions' signatures: ``last_epoch`` made torch ask a fresh scheduler for the rates of a resumed
    one (a KeyError), and transformers drops every key of the constant schedules without a word."""
    kwargs = args.lr_scheduler_kwargs if isinstance(args.lr_scheduler_kwargs, dict) else {}
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    takes = _scheduler_keys(kind)
    for key in kwargs:
        if key in _trainer_keys():
            why = _SET_BY_THE_TRAINER.get(key, "it passes it to the scheduler")
            raise ConfigurationError(
                f"--lr_scheduler_kwargs {kwargs}: {key} is not a key a run takes: the Trainer sets it itself ({why}); "
                "leave it out"
            )
        if takes is not None and key not in takes:
            keys = f"its keys are {', '.join(takes)}" if takes else "it takes none"
            raise ConfigurationError(
                f"--lr_scheduler_kwargs {kwargs}: {key} is not a key of --lr_scheduler_type {kind} ({keys}); leave "
                "it out"
            )
    return kwargs


def _trainer_keys() -> set[str]:
    """The scheduler's arguments the Trainer sets itself: get_scheduler's (but the type and the kwargs) and
    ``last_epoch``."""
    return {*inspect.signature(get_scheduler).parameters, *_SET_BY_THE_TRAINER} - {"name", "scheduler_specific_kwargs"}


def _scheduler_keys(kind: str) -> Optional[list[str]]:
    """The keys the scheduler function of ``kind`` takes besides the Trainer's; None where it takes any (``**kwargs``)
    or ``kind`` is no scheduler type (get_scheduler names it)."""
    try:
        parameters = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(kind)]).parameters.values()
    except (ValueError, KeyError):
        return None
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return None
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in keywords and p.name not in _trainer_keys()]


__all__ = [
    "CONTINUED_PRETRAINING",
    "TaperSchedule",
    "checked_scheduler_kwargs",
    "decay_learning_rate_after_the_taper",
    "fit_default_window",
]
