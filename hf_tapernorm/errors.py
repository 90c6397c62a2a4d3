"""The exceptions hf_tapernorm raises: one base, a subclass per kind of failure.

Callers (the CLI first of all) catch :class:`TaperNormError` to tell the package's own, explained
failures from bugs. Each subclass also derives from the builtin that the same misuse raised before
the hierarchy existed (``ValueError`` for bad input, ``RuntimeError`` for a state that does not allow
the operation), so ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

import threading
from typing import Optional


def first_line(error: BaseException) -> str:
    """``Type: first line`` of an error raised by a dependency: their messages run over several lines, and the
    package's own errors are one line."""
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}".rstrip(": ")


def main_thread_ended() -> Optional[str]:
    """Why nothing more loads, when this call runs in a worker thread whose program's main thread has ended (a script
    that returned without joining it, a web UI's thread after an uncaught Ctrl-C); None otherwise. The interpreter is
    shutting down then: it starts no worker pools and registers no exit hooks, so a loader's failure there says
    nothing of the model or the dataset it was given, and a first ``import torch`` fails."""
    if threading.main_thread().is_alive():
        return None
    return (
        "the program's main thread has ended (it returned, or an error or Ctrl-C stopped it), and the interpreter "
        "shutting down loads nothing more; keep the main thread running until the command returns (join the thread "
        "that runs it)"
    )


class TaperNormError(Exception):
    """Base class of every error hf_tapernorm raises on purpose."""


class ConfigurationError(TaperNormError, ValueError):
    """An option or a :class:`~hf_tapernorm.TaperNormConfig` value that cannot work (named in the message)."""


class UnsupportedModelError(TaperNormError, ValueError):
    """A model whose norms cannot be tapered or folded: unknown layout, post-norm residuals, unreadable norm."""


class TaperStateError(TaperNormError, RuntimeError):
    """The model's taper state does not allow the operation: not patched, already patched, uncalibrated,
    a gate above 0 where folding needs 0, a checkpoint that does not match the run."""


class CalibrationError(TaperStateError):
    """Calibration statistics are missing, zero or not finite for a layer (the message names it)."""


class TaperDivergenceError(TaperNormError, RuntimeError):
    """Training diverged while tapering: the message names the step, the gate and what ran away."""


class FoldCheckError(TaperNormError, RuntimeError):
    """The folded model's logits differ from the unfolded g = 0 model's by more than the tolerance."""


__all__ = [
    "CalibrationError",
    "ConfigurationError",
    "FoldCheckError",
    "TaperDivergenceError",
    "TaperNormError",
    "TaperStateError",
    "UnsupportedModelError",
]
