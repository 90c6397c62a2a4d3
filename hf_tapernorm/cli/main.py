"""``hf-tapernorm``: dispatch a subcommand and turn the package's errors into one-line messages.

Every error the package explains (``TaperNormError``) prints as ``hf-tapernorm COMMAND: error: ...`` on
stderr with exit status 2 (usage, configuration, model or data problems) or 1 (training diverged, the
fold check failed: the run was valid, its result is not, and nothing was exported). ``--debug`` (anywhere
on the command line, but before a value after the command word: ``--debug underflow_overflow`` is the Trainer's
option) or
``HF_TAPERNORM_DEBUG=1`` shows the traceback instead.

SIGTERM (``docker stop``, Slurm, Kubernetes) is Ctrl-C: during training both save a checkpoint and stop
(app/training_run.py); anywhere else both unwind the command, so a half-written output is removed, the
run folder's lock released and the report says how far the run got (exit 143 for SIGTERM, 130 for Ctrl-C).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

from ..errors import FoldCheckError, TaperDivergenceError, TaperNormError, main_thread_ended

if TYPE_CHECKING:
    from ..app.extension import TaperExtension

DEBUG_FLAG = "--debug"
DEBUG_ENV = "HF_TAPERNORM_DEBUG"


def taper_main(argv: Sequence[str], extension: Optional[TaperExtension] = None) -> int:
    """``hf-tapernorm taper``: continued pretraining with the recipe, then evaluate, fold, export, report.
    ``extension``: an experiment's ``app.extension.TaperExtension`` (its extra callback, terms, log keys)."""
    from .._parsing import as_flags, parse
    from ..app.taper import TaperRequest, run_taper
    from .arguments import DataArguments, ModelArguments, RunArguments, TaperArguments, TaperTrainingArguments

    options = [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments]
    parsed = parse(options, argv, "hf-tapernorm taper")
    try:
        return run_taper(TaperRequest(*parsed), extension)
    except TaperNormError as error:  # the pipeline names fields (TaperNormConfig.taper_end): say --taper_end
        translated = as_flags(error, options)
        if translated is error:
            raise
        raise translated from error


def eval_main(argv: Sequence[str]) -> int:
    from .commands import eval_main as run

    return run(argv)


def fold_main(argv: Sequence[str]) -> int:
    from .commands import fold_main as run

    return run(argv)


def push_main(argv: Sequence[str]) -> int:
    from .commands import push_main as run

    return run(argv)


def bench_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm bench``: the inference/training benchmark (hf_tapernorm/bench)."""
    from ..bench.runner import main as run

    return run(list(argv)) or 0


# Subcommands import their modules on use: `hf-tapernorm --help` stays instant.
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "taper": (taper_main, "continued pretraining with TaperNorm, then evaluate, fold, export and report"),
    "fold": (fold_main, "fold a saved tapered checkpoint into a norm-free export"),
    "eval": (eval_main, "held-out loss of an original model, a tapered checkpoint (g = 0) or a folded export"),
    "push": (push_main, "push a folded export and its model card to the Hugging Face Hub"),
    "bench": (bench_main, "benchmark the original, tapered and folded models"),
}

USAGE = (
    "usage: hf-tapernorm {"
    + ",".join(COMMANDS)
    + "} [options] [--debug]   (hf-tapernorm COMMAND --help)\n\n"
    + "\n".join(f"  {name:<6} {description}" for name, (_, description) in COMMANDS.items())
)


def main(argv: Optional[Sequence[str]] = None, *, extension: Optional[TaperExtension] = None) -> int:
    """Entry point of the ``hf-tapernorm`` console script; returns the exit status. ``extension`` (a
    ``TaperExtension``, for ``taper`` only) is how an experiment runs the command with its own training parts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    switched, argv = take_debug_switch(argv)
    debug = switched or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-tapernorm: error: unknown command '{command}'\n{USAGE}", file=sys.stderr)
        return 2
    if (ended := main_thread_ended()) is not None:  # a worker thread's command: a first `import torch` would fail
        print(f"hf-tapernorm {command}: error: {ended}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        from .._options_file import file_paths_noted  # with the command: `hf-tapernorm --help` imports no torch

        with file_paths_noted():
            return _run(command, rest, extension, debug)
    except KeyboardInterrupt as interruption:
        terminated = isinstance(interruption, Terminated)
        print(f"hf-tapernorm {command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except Exception:
        ended = main_thread_ended()  # it ended during the command: a first `import torch` fails, as any load does
        if ended is None or debug:
            raise
        print(f"hf-tapernorm {command}: error: {ended}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(command: str, rest: list[str], extension: Optional[TaperExtension], debug: bool) -> int:
    """Run ``command``; an error the package explains is one line (a path an options file gave that is not found
    says where it was looked for: with_file_path_hint), exit status 2 (1: a run whose result failed)."""
    from .._options_file import with_file_path_hint

    try:
        if extension is not None:
            if command != "taper":
                raise ValueError(f"main(extension=...) applies to the taper command, not '{command}'")
            return taper_main(rest, extension)
        return COMMANDS[command][0](rest)
    except TaperNormError as error:
        if debug:
            raise
        failed_run = isinstance(error, (TaperDivergenceError, FoldCheckError))
        suffix = "; no export was written" if failed_run else ""
        print(f"hf-tapernorm {command}: error: {with_file_path_hint(error)}{suffix}", file=sys.stderr)
        return 1 if failed_run else 2


def take_debug_switch(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether ``argv`` asks for tracebacks, and ``argv`` without that switch. After the command word, ``--debug``
    followed by a value (a word that starts with no ``-`` and names no options file) is the Trainer's option of that
    name, left to the command's parser, which refuses a value that is no debug feature in one line; any other
    ``--debug`` (before the command word, last, before an option or an options file) is the switch. Taking the
    ``--debug`` of a misspelt feature left its value over, refused as a traceback (the switch re-raises)."""
    kept, switched, value_next = [], False, False
    for index, word in enumerate(argv):
        if value_next:  # the Trainer's parser takes the features as words: "a b" is a, b (as an options file reads it)
            kept.extend(word.split() or [word])
            value_next = False
        elif word != DEBUG_FLAG:
            kept.append(word)
        elif kept and _debug_value(argv[index + 1 : index + 2]):  # kept: the command word came before it
            kept.append(word)
            value_next = True
        else:
            switched = True
    return switched, kept


#: The endings of an options file (``taper run.yaml``): ``--debug run.yaml`` is the switch, then the file.
_OPTIONS_FILE_ENDINGS = (".json", ".yaml", ".yml")


def _debug_value(following: list[str]) -> bool:
    """Whether the word after ``--debug`` (a list of none or one) is a value of the Trainer's option: one that starts
    with no ``-`` and is no options file (a misspelt feature too, so that the parser names it)."""
    if not following:
        return False
    word = following[0]
    return not word.startswith("-") and not word.strip().lower().endswith(_OPTIONS_FILE_ENDINGS)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside training: unwinds the command like Ctrl-C (finally blocks run, partial outputs go)."""


def _terminate(signum, frame) -> None:
    raise Terminated


def command(name: str) -> Callable[[], None]:
    """A console-style entry point for one subcommand (used by conversion_scripts/)."""

    def run() -> None:
        sys.exit(main([name, *sys.argv[1:]]))

    return run


__all__ = ["COMMANDS", "command", "main"]
