"""Argument parsing for every command line of the package (``hf-tapernorm``'s subcommands in cli/, the
benchmark in bench/): ``HfArgumentParser`` whose errors are one-line usage errors, and the translation of
field names into flag names.

It sits at the bottom of the layers so that cli/ and bench/ share it without importing each other.
Below the command line, errors name fields as ``TaperNormConfig.taper_end`` or
``TrainingArguments.max_steps`` (a Python caller sees the names it passed); :func:`as_flags` rewrites those
into the flags of the command that was run (``--taper_end``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from transformers import HfArgumentParser

from .errors import ConfigurationError, TaperNormError

#: ``Class.field`` as the layers below the command line name a field in their errors.
_FIELD = re.compile(r"\b(?:TaperNormConfig|TrainingArguments)\.([a-z_][a-z0-9_]*)")


class UsageError(ConfigurationError):
    """A usage error reported as one line on stderr (exit status 2), without a traceback."""


class _Parser(HfArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print the usage block and exit
        raise UsageError(f"{message} (see {self.prog} --help)")


def parse(dataclass_types: Sequence[type], argv: Sequence[str], prog: str) -> tuple[Any, ...]:
    """Parse ``argv`` (or one JSON/YAML file of all options, as transformers' example scripts accept)."""
    parser = _Parser(list(dataclass_types), prog=prog)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = os.path.abspath(argv[0])
        if not os.path.isfile(path):
            raise UsageError(f"options file '{argv[0]}' not found")
        try:
            return tuple(parser.parse_json_file(path) if path.endswith(".json") else parser.parse_yaml_file(path))
        except AttributeError:  # the file holds a list or a scalar: HfArgumentParser calls .keys() on it
            raise UsageError(f"{argv[0]}: an options file holds one object of option names and values") from None
        except (ValueError, TypeError) as error:
            if isinstance(error, ConfigurationError):
                raise
            raise UsageError(f"{argv[0]}: {error}") from None
    try:
        return tuple(parser.parse_args_into_dataclasses(args=list(argv)))
    except ValueError as error:
        if isinstance(error, ConfigurationError):
            raise
        message = str(error)
        if message.startswith("Some specified arguments are not used"):
            unused = message.split(":", 1)[1].strip()
            raise UsageError(f"unrecognized arguments: {unused} (see {prog} --help)") from None
        raise UsageError(message) from None


def as_flags(error: TaperNormError, dataclass_types: Iterable[type]) -> TaperNormError:
    """``error`` with every field name that is an option of these dataclasses written as its flag
    (``TaperNormConfig.ema_rate`` -> ``--ema_rate``); the same class, so the exit status stays the same."""
    flags = {f.name for cls in dataclass_types for f in dataclasses.fields(cls)}
    text = _FIELD.sub(lambda m: f"--{m[1]}" if m[1] in flags else m[0], str(error))
    if text == str(error):
        return error
    try:
        return type(error)(text)
    except TypeError:  # an error class whose constructor takes more than the message
        return error


__all__ = ["UsageError", "as_flags", "parse"]
