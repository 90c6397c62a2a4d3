"""The argument checks of TaperController's calls, each run before the call changes anything.

A call refused halfway (the EMA statistics folded in, the step ended) could not be retried: every argument is read
here first, into the plain int or float the controller goes on with, or refused in one line naming it.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigurationError
from ..layers.taper_norm import TaperNorm
from .distillation import Distillation
from .schedule import TaperSchedule


def check_controller_arguments(model: object, schedule: object, distillation: object) -> None:
    """Refuse TaperController's arguments of the wrong kind in one line, before anything reads them: a schedule given
    as a dict or a tuple failed with "'dict' object has no attribute 'resolve'", a model of None with an
    AttributeError of its own, and ``distillation="no"`` or ``0`` (not False) built a teacher and trained with it."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"TaperController: model must be a model patched with patch_model, got {model!r}")
    if schedule is not None and not isinstance(schedule, TaperSchedule):
        spelled = {dict: f"TaperSchedule(**{schedule!r})", tuple: f"TaperSchedule(*{schedule!r})"}.get(type(schedule))
        raise ConfigurationError(
            f"TaperController: schedule must be a TaperSchedule, got a {type(schedule).__name__}"
            + (f": write {spelled}" if spelled else "")
        )
    if distillation is not None and not isinstance(distillation, (bool, Distillation)):
        raise ConfigurationError(
            "TaperController: distillation must be True or False (the config's teacher, or none) or a Distillation, "
            f"got {distillation!r}"
        )


def refuse_norms_in_modules_to_save(model: nn.Module) -> None:
    """Refuse a model whose TaperNorm sits in PEFT's ``modules_to_save``: PEFT runs and trains a copy of it, and the
    original, which the controller calibrates too, never runs, so the taper's first step failed with "no calibration
    statistics: run training-mode forwards", after the whole warmup and blaming the forwards. Told by the wrapper's
    attributes (``original_module`` beside a ``modules_to_save`` dict), so PEFT need not be installed."""
    for name, module in model.named_modules():
        original, copies = getattr(module, "original_module", None), getattr(module, "modules_to_save", None)
        if not (isinstance(copies, nn.ModuleDict) and isinstance(original, nn.Module)):
            continue
        if any(isinstance(inner, TaperNorm) for inner in original.modules()):
            raise ConfigurationError(
                f"{name} is in PEFT's modules_to_save: PEFT trains a copy of its TaperNorm while the original, "
                "which the taper calibrates, never runs; leave the norms out of modules_to_save and call "
                "train_tapernorm_parameters(model) after get_peft_model (docs/usage.md, LoRA / PEFT)"
            )


def whole_step(step: object, call: str) -> int:
    """``step`` as an int, refused in one line unless a whole number of 0 or more: a bool (read as 0 or 1), or a
    fraction (a loop passing its micro-batch over the accumulation) would set a new gate for every micro-batch, each
    with its own statistics update; a text is no number, and a negative step no count of updates completed (the
    Trainer's global_step starts at 0). Whole numbers of any kind are taken: 3.0, a tensor or a numpy integer; an
    int is read as one (operator.index), never through a float, which an int too large for one overflows."""
    value = _whole_number(step)
    if value is None:
        raise ConfigurationError(
            f"TaperController.{call}: step must be a whole number of optimizer steps completed (an int), got "
            f"{step!r}; count optimizer updates, not micro-batches (the gate is constant over one update's)"
        )
    if value < 0:
        raise ConfigurationError(
            f"TaperController.{call}: step must be the number of optimizer steps completed, 0 or more, got {step!r}; "
            "the first update is step_begin(0) (the Trainer's state.global_step, which starts at 0)"
        )
    return value


def _whole_number(step: object) -> Optional[int]:
    """The whole number ``step`` holds (an int, a numpy or torch integer, a whole float), or None for anything else."""
    dtype = getattr(step, "dtype", None)
    if isinstance(step, (bool, str, bytes)) or dtype is torch.bool or getattr(dtype, "kind", None) == "b":
        return None
    try:
        return operator.index(step)  # ints of any size and kind, without a float's rounding or overflow
    except (TypeError, ValueError, RuntimeError):
        pass
    try:
        value = float(step)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # not a number, several, or too large for a float
        return None
    return int(value) if math.isfinite(value) and value == math.floor(value) else None


#: What each watched value is, for the refusal's advice.
_WATCHED = {
    "loss": "the step's loss (outputs.loss, or loss.item())",
    "grad_norm": "the step's gradient norm (what clip_grad_norm_ returns)",
}


def watched_value(value: object, name: str, call: str) -> Optional[float]:
    """``value`` (the ``loss`` or ``grad_norm`` of step_end or check) as a float, None for None, refused in one line
    unless one number: a text would have raised a raw TypeError from the watch, and a tensor of several values a
    ValueError, after step_end had already folded the step into the statistics. A number of any kind is taken (a
    numpy scalar, a one-element tensor); nan and inf are numbers, which the divergence watch stops the run on."""
    if value is None:
        return None
    number = _one_number(value)
    if number is None:
        raise ConfigurationError(
            f"TaperController.{call}: {name} must be a number or a one-element tensor, got {_shown(value)}; "
            f"pass {_WATCHED[name]}"
        )
    return number


def _one_number(value: object) -> Optional[float]:
    """The one real number ``value`` holds (a Python, numpy or torch number, a one-element array), else None."""
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    if isinstance(size, int):  # a tensor or a numpy array or scalar: one element, read as a Python number
        if size != 1:
            return None
        try:
            value = value.item()
        except (AttributeError, TypeError, ValueError, RuntimeError):  # a meta tensor's (no value), a DataFrame's
            return None
    if isinstance(value, (bool, str, bytes)):  # float("2.0") would read a text; a bool is no loss
        return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float: not finite, as the watch reads it
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError, RuntimeError):  # not a number (a list, a complex number, ...)
        return None


def _shown(value: object) -> str:
    """``value`` for the refusal: a tensor, array or table by its shape (a DataFrame's repr takes several lines),
    anything else as Python writes it."""
    if getattr(value, "is_meta", False) is True:  # its repr, "tensor(..., device='meta')", hides why it is refused
        return f"a {type(value).__name__} on the meta device (it holds no value)"
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and len(shape) > 0:  # torch.Size is a tuple
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    return repr(value)


__all__ = ["check_controller_arguments", "refuse_norms_in_modules_to_save", "watched_value", "whole_step"]
