"""Argument parsing for every subcommand: ``HfArgumentParser`` whose errors are one-line usage errors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NoReturn

from transformers import HfArgumentParser

from ..errors import ConfigurationError


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


__all__ = ["UsageError", "parse"]
