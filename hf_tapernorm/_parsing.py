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
import json
import os
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Optional, Union

import yaml
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
    if argv and _is_options_file(argv[0]) and len(argv) > 1:  # argparse would call it an unrecognized argument
        raise UsageError(
            f"the options file {argv[0]} is read alone: put {argv[1]} and the other options into it, or pass every "
            f"option as a flag (see {prog} --help)"
        )
    if len(argv) == 1 and _is_options_file(argv[0]):
        path = os.path.abspath(argv[0])
        if not os.path.isfile(path):
            raise UsageError(f"options file '{argv[0]}' not found")
        values = _read_options_file(path, argv[0])
        try:
            return tuple(parser.parse_dict(_numbers_from_text(values, dataclass_types, argv[0])))
        except (ValueError, TypeError) as error:
            if isinstance(error, ConfigurationError):
                raise
            message = str(error)
            if message.startswith("Some keys are not used"):  # HfArgumentParser.parse_dict on unknown keys
                message = f"unknown options {message.split(':', 1)[1].strip()} (see {prog} --help)"
            raise UsageError(f"{argv[0]}: {message}") from None
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


def _is_options_file(argument: str) -> bool:
    """Whether a command-line argument names an options file (run.json, RUN.YAML), not a flag or its value."""
    return not argument.startswith("-") and argument.lower().endswith((".json", ".yaml", ".yml"))


def _read_options_file(path: str, name: str) -> dict[str, Any]:
    """The object of an options file (JSON or YAML), or a UsageError naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle) if path.lower().endswith(".json") else yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as error:
        raise UsageError(
            f"{name}: cannot read it ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from None
    if not isinstance(values, dict):
        raise UsageError(f"{name}: an options file holds one object of option names and values")
    return values


def _numeric_type(hint: Any) -> Optional[type]:
    """float or int when ``hint`` is one of them, alone or with None; else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is Union else [hint]
    return args[0] if len(args) == 1 and args[0] in (float, int) else None


def _numbers_from_text(values: dict[str, Any], dataclass_types: Sequence[type], name: str) -> dict[str, Any]:
    """``values`` with the numbers YAML reads as text (``1e-1``, ``3e-4``: YAML 1.1 wants a dot in a float) as
    numbers, for the options that take one; text that is no number, or a fraction for an integer option, is refused
    with its option (the file's values reach the dataclasses unconverted)."""
    kinds: dict[str, type] = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        kinds.update({f.name: kind for f in dataclasses.fields(cls) if (kind := _numeric_type(hints.get(f.name)))})
    converted = dict(values)
    for key, value in values.items():
        kind = kinds.get(key)
        if kind is None or isinstance(value, bool) or not isinstance(value, (str, float)):
            continue
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{name}: {key} must be a number, got {value!r}") from None
        if kind is int and not number.is_integer():
            raise UsageError(f"{name}: {key} must be an integer, got {value!r}")
        converted[key] = int(number) if kind is int else number
    return converted


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
