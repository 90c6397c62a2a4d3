"""The types of the command line's values, shared by the parser (_parsing.py) and the reading of an options file
(_options_file.py): what a text or number option's value must be, whatever its source, and what a field's type hint
allows, in the words of ``--help``.
"""

from __future__ import annotations

import argparse
import enum
import math
import types
import typing
from typing import Any, Union

from .errors import ConfigurationError


class UsageError(ConfigurationError):
    """A usage error reported as one line on stderr (exit status 2), without a traceback."""


def text_value(value: str) -> str:
    """The type of every text option: text, which any path or option value can hold. A byte of argv that is not
    UTF-8 arrives as a lone surrogate (Python decodes argv with surrogateescape) as does a file's ``"\\udce9"``:
    no character, which the command accepts and then fails on where it writes the name, after the work."""
    if "\0" in value:
        raise argparse.ArgumentTypeError(
            f"{value!r} holds a NUL byte (\\u0000), which no path or option value can hold"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(
            f"{value!r} holds {value[error.start]!r}, which is no character (a byte that is not UTF-8, or half of a "
            "UTF-16 surrogate pair): write it as UTF-8 text"
        ) from None
    return value


def one_line_value(value: str) -> str:
    """The type of an option whose declared type is text (a path, a name, a pattern): :func:`text_value` on one line. A
    line break is any character ``str.splitlines`` breaks at (``\\n``, ``\\r``, U+2028, NEL, ...); a YAML block
    scalar ends with one."""
    breaks = [character for character in text_value(value) if character.splitlines() != [character]]
    if breaks:
        raise argparse.ArgumentTypeError(
            f"{value!r} holds a line break ({breaks[0]!r}), which a path or name cannot hold: write it on one line"
        )
    return value


def finite_float(text: str) -> float:
    """A number option's value: a float, and not NaN or infinity, which pass most range checks (every comparison
    with NaN is false, ``inf > 0``) and would fail only once the model is loaded, or train on nonsense."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def is_text(hint: Any) -> bool:
    """Whether an option's values are text (a path, a name, a choice of words; or a list of them), not numbers."""
    members = [typing.get_args(m)[0] if typing.get_origin(m) is list else m for m in hint_members(hint)]
    return all(
        m is str or (typing.get_origin(m) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(m)))
        for m in members
    )


def takes_a_list(hint: Any) -> bool:
    """Whether a one-value option's field takes a list too (Trainer's ``report_to: [wandb]``, as its configs write
    it): a one-item list is then its item. A list for any other one-value option (``block_size: [16]``) is refused."""
    return any(typing.get_origin(member) is list for member in hint_members(hint))


def hint_members(hint: Any) -> list[Any]:
    """The types a field's type hint allows: the members of a Union (``X | None``: X), or the hint itself."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [m for m in typing.get_args(hint) if m is not type(None)]
    return [hint]


def type_text(hint: Any) -> str:
    """A field's type as its --help reader knows it: ``text``, ``an integer``, ``one of auto, bos, none``."""
    texts = []
    for member in hint_members(hint):
        origin = typing.get_origin(member)
        if origin is typing.Literal:
            texts.append("one of " + ", ".join(map(str, typing.get_args(member))))
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            texts.append("one of " + ", ".join(str(item.value) for item in member))
        elif origin is list:
            texts.append("a list of " + type_text(typing.get_args(member)[0]))
        else:
            plain = {str: "text", bool: "true or false", int: "an integer", float: "a number", dict: "an object"}
            texts.append(plain.get(origin or member, getattr(member, "__name__", str(member))))
    return " or ".join(texts)


__all__ = [
    "UsageError",
    "finite_float",
    "hint_members",
    "is_text",
    "one_line_value",
    "takes_a_list",
    "text_value",
    "type_text",
]
