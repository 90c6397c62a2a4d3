"""Argument parsing for every command line of the package (``hf-tapernorm``'s subcommands in cli/, the
benchmark in bench/): ``HfArgumentParser`` whose errors are one-line usage errors and whose number options refuse
NaN and infinity, an options file read as the flags it stands for (one parse, one set of checks, whatever the
source), and the translation of field names into flag names.

It sits at the bottom of the layers so that cli/ and bench/ share it without importing each other.
Below the command line, errors name fields as ``TaperNormConfig.taper_end`` or
``TrainingArguments.max_steps`` (a Python caller sees the names it passed); :func:`as_flags` rewrites those
into the flags of the command that was run (``--taper_end``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
import re
import types
import typing
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NoReturn, Optional, Union

import yaml
from transformers import HfArgumentParser

from .errors import ConfigurationError, TaperNormError

#: ``Class.field`` (or ``Class.group.field``) as the layers below the command line name a field in their errors.
_FIELD = re.compile(r"\b(?:TaperNormConfig|TrainingArguments)\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)")


class UsageError(ConfigurationError):
    """A usage error reported as one line on stderr (exit status 2), without a traceback."""


class _Parser(HfArgumentParser):
    """transformers' parser, with one-line errors and each field's option at hand (``options``): an options file is
    read through it as the flags it stands for."""

    def __init__(self, dataclass_types: Sequence[type], prog: str, source: Optional[str] = None) -> None:
        #: field name -> its argparse action (the option named after the field, not its ``--no_`` complement)
        self.options: dict[str, argparse.Action] = {}
        #: every flag as an options file may spell it (``no_private``, ``model_name_or_path``) -> its action
        self.flags: dict[str, argparse.Action] = {}
        self.source = source  # the options file being read, named in every error
        super().__init__(list(dataclass_types), prog=prog)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if kwargs.get("type") is float:  # one check for every number option of every command, before any work
            kwargs["type"] = _finite_float
        action = super().add_argument(*args, **kwargs)
        if f"--{action.dest}" in action.option_strings:
            self.options[action.dest] = action
        self.flags.update({s[2:].replace("-", "_"): action for s in action.option_strings if s.startswith("--")})
        return action

    def error(self, message: str) -> NoReturn:  # argparse would print the usage block and exit
        raise UsageError(f"{f'{self.source}: ' if self.source else ''}{message} (see {self.prog} --help)")


def _finite_float(text: str) -> float:
    """A number option's value: a float, and not NaN or infinity, which pass most range checks (every comparison
    with NaN is false, ``inf > 0``) and would fail only once the model is loaded, or train on nonsense."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def parse(dataclass_types: Sequence[type], argv: Sequence[str], prog: str) -> tuple[Any, ...]:
    """Parse ``argv``, or one JSON/YAML file of all options (as transformers' example scripts accept).

    A file is read as the flags it stands for (:func:`_command_line`) by the same argparse parse, so its values get
    the command line's types, choices and checks: ``"trust_remote_code": "false"`` is false, ``sink: bogus`` is
    refused, whatever the source."""
    source = None
    if argv and _is_options_file(argv[0]):
        if len(argv) > 1:  # argparse would call it an unrecognized argument
            raise UsageError(
                f"the options file {argv[0]} is read alone: put {argv[1]} and the other options into it, or pass "
                f"every option as a flag (see {prog} --help)"
            )
        source = argv[0]
    parser = _Parser(dataclass_types, prog, source)
    if source is not None:
        path = os.path.abspath(source)
        if os.path.isdir(path):
            raise UsageError(f"options file '{source}' is a folder; name a JSON or YAML file of options")
        if not os.path.isfile(path):
            raise UsageError(f"options file '{source}' not found")
        hints, separators, empty = _declared(dataclass_types)
        as_written = {
            flag
            for flag, action in parser.flags.items()
            if action.dest in hints and (_is_text(hints[action.dest]) or action.type in (int, _finite_float))
        }
        argv = _command_line(parser, _read_options_file(path, source, as_written), hints, separators, empty)
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


def _read_options_file(path: str, name: str, as_written: Collection[str]) -> dict[str, Any]:
    """The object of an options file (JSON or YAML), or a UsageError naming the file. A leading byte order mark
    (what some editors write into UTF-8) is no part of the text. YAML 1.1 reads ``010``, ``12:30``, ``0b11`` and
    ``0x1F`` as numbers (8, 750, 3, 31) and ``2024-01-02`` as a date, where the command line reads ``--max_steps
    010`` as 10 and refuses the others: the value of a text or number option (``as_written``: a folder, a dataset
    name, a step count) is its text as written, given to the option's own type as the flag's text is."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            if path.lower().endswith(".json"):
                values = json.load(handle)
            else:
                loader = yaml.SafeLoader(handle)
                try:
                    node = loader.get_single_node()
                    values = loader.construct_document(node) if node is not None else None
                finally:
                    loader.dispose()
                if isinstance(values, dict) and isinstance(node, yaml.MappingNode):
                    for key, value in node.value:  # merge keys already flattened into it; the last of a key wins
                        if isinstance(key.value, str) and key.value.replace("-", "_") in as_written:
                            values[key.value] = _as_written(value, values[key.value])
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError, RecursionError) as error:  # deep: recursion
        raise UsageError(
            f"{name}: cannot read it ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from None
    if not isinstance(values, dict):
        raise UsageError(f"{name}: an options file holds one object of option names and values")
    return values


#: The types YAML 1.1 resolves a plain scalar to that may have been meant as text (``010``, ``1:30``, ``2024-01-02``).
_NUMBER_TAGS = {f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "timestamp")}


def _as_written(node: yaml.Node, value: Any) -> Any:
    """``value`` (YAML's reading of ``node``) with every number or date in it as the text the file holds; but
    YAML's own spellings of infinity and NaN (``.inf``, ``.nan``), which no flag has, stay numbers, to be refused
    as not finite."""
    if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS:
        return value if isinstance(value, float) and not math.isfinite(value) else node.value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        return [_as_written(item, v) for item, v in zip(node.value, value)]
    return value


def _declared(dataclass_types: Sequence[type]) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """Each option's type as declared (HfArgumentParser rewrites each Field's), and the classes' ``SEPARATORS``
    (option -> the text between the items of an option that lists several things in one value, ``--keep_norms
    a,b``) and ``EMPTY`` (option -> how its flag spells an empty list, ``--report_to none``)."""
    hints, separators, empty = {}, {}, {}
    for cls in dataclass_types:
        declared = typing.get_type_hints(cls)
        hints.update({f.name: declared[f.name] for f in dataclasses.fields(cls) if f.init})
        separators.update(getattr(cls, "SEPARATORS", {}))
        empty.update(getattr(cls, "EMPTY", {}))
    return hints, separators, empty


def _is_text(hint: Any) -> bool:
    """Whether an option's values are text (a path, a name, a choice of words; or a list of them), not numbers."""
    members = [typing.get_args(m)[0] if typing.get_origin(m) is list else m for m in _members(hint)]
    return all(
        m is str or (typing.get_origin(m) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(m)))
        for m in members
    )


def _command_line(
    parser: _Parser, values: dict[str, Any], hints: dict[str, Any], separators: dict[str, str], empty: dict[str, str]
) -> list[str]:
    """The command line an options file stands for: ``--key=value`` for each key (null: the option left at its
    default). A key is any flag of the command, spelled with ``_`` or ``-`` (``no_private: true`` is
    ``--no_private``). A list gives a several-value option its values, and a one-value option its one element, or
    its items joined by its separator. An empty list is the option's empty value: its flag's spelling of one
    (``EMPTY``), else no value, the option's default as with null (a several-value option whose default is not
    empty cannot be empty: refused as on the command line). Keys that are no option are refused together, named."""
    texts = [key for key in values if not isinstance(key, str)]
    if texts:  # YAML reads `1:` or `~:` as a number or null
        raise UsageError(f"{parser.source}: option names are text, got {texts[0]!r} (see {parser.prog} --help)")
    flags = {key: parser.flags.get(key.replace("-", "_")) for key in values}  # --model-name-or-path is a flag too
    unknown = [key for key, action in flags.items() if action is None or action.dest not in hints]
    if unknown:
        raise UsageError(f"{parser.source}: unknown options {unknown} (see {parser.prog} --help)")
    argv: list[str] = []
    for key, value in values.items():
        flag = flags[key]
        name = flag.dest
        action, hint = parser.options[name], hints[name]
        if flag is not action and flag.nargs == 0 and value is not None:  # --no_private: true sets it, false not
            value = flag.const if _as_bool(value, key, action, parser) else not flag.const
        if value == [] and name in empty:
            value = empty[name]
        if value is None or (value == [] and not (action.nargs in ("+", "*") and action.default)):
            continue
        if not isinstance(value, list):
            argv.append(f"--{name}={_as_text(value, key, hint, action, parser)}")
        elif action.nargs in ("+", "*"):
            item = next((typing.get_args(m)[0] for m in _members(hint) if typing.get_origin(m) is list), Any)
            argv += [f"--{name}", *(_as_text(v, key, item, action, parser) for v in value)]
        elif len(value) == 1 or (value and name in separators):
            items = [_as_text(v, key, hint, action, parser) for v in value]
            argv.append(f"--{name}={separators.get(name, '').join(items)}")
        else:
            raise UsageError(
                f"{parser.source}: {key} takes one value, got the list {value!r} (see {parser.prog} --help)"
            )
    return argv


def _as_bool(value: Any, key: str, action: argparse.Action, parser: _Parser) -> bool:
    """The value of a flag that takes none (``no_private``), read as its option's bool (true, no, 1, ...)."""
    try:
        return value if isinstance(value, bool) else bool(action.type(str(value)))
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        raise UsageError(
            f"{parser.source}: {key} takes true or false, got {value!r} (see {parser.prog} --help)"
        ) from None


def _as_text(value: Any, key: str, hint: Any, action: argparse.Action, parser: _Parser) -> str:
    """One value of an options file as the command line writes it: bools as true/false and objects as JSON text
    where the field's type takes them (a bool, a dict), and numbers as numbers however YAML read them (``1e-1``,
    ``3e-4``: YAML 1.1 wants a dot in a float, so it reads them as text; ``2e1`` for an integer option is 20). A
    bool or an object for an option of another type (``"output_dir": true`` would be a folder named true), a list
    in a list, text that is no number, or a fraction for an integer option, is refused naming the option; so is
    text no path or option can hold, which a file can carry and argv cannot: a NUL, a lone UTF-16 surrogate, a
    line break in a text option (a YAML block scalar ends with one), YAML's binary data, and a null item in a
    list."""
    name = parser.source
    if value is None:  # an item of a list (an option's own null is its default): `[null]` would be the text None
        raise UsageError(f"{name}: {key} holds an empty item (null): remove it, or write the value")
    if isinstance(value, (bytes, bytearray)):  # YAML's !!binary: str() would make it the text "b'...'"
        raise UsageError(f"{name}: {key} takes {_type_text(hint)}, got binary data (!!binary); write it as text")
    if isinstance(value, str):
        if _is_text(hint) and ("\n" in value or "\r" in value):  # a block scalar (`|`, `>`) keeps its final one
            raise UsageError(
                f"{name}: {key} holds a line break, which a path or name cannot hold: write it on one line, as a "
                "plain or quoted value"
            )
        if "\0" in value:
            raise UsageError(f"{name}: {key} holds a NUL byte (\\u0000), which no path or option value can hold")
        try:
            os.fsencode(value)  # what opening it as a path does first
        except UnicodeEncodeError as error:
            raise UsageError(
                f"{name}: {key} holds {value[error.start]!r}, half of a UTF-16 surrogate pair, which is no "
                "character: write the character itself"
            ) from None
    members = _members(hint)
    takes = {
        bool: Any in members or bool in members,
        dict: Any in members or any(m is dict or typing.get_origin(m) is dict for m in members),
        list: False,  # a list inside the file's list
    }
    kind = next((kind for kind in takes if isinstance(value, kind)), None)
    if kind is not None and not takes[kind]:
        raise UsageError(
            f"{name}: {key} takes {_type_text(hint)}, got {json.dumps(value)}; write it as the command line "
            f"does (see {parser.prog} --help)"
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    if action.type in (int, _finite_float) and isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{name}: {key} must be a number, got {value!r}") from None
        if action.type is _finite_float:
            return str(value)
        if not number.is_integer():
            raise UsageError(f"{name}: {key} must be an integer, got {value!r}")
        return value if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else str(int(number))
    return str(value)


def _members(hint: Any) -> list[Any]:
    """The types a field's type hint allows: the members of a Union (``X | None``: X), or the hint itself."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [m for m in typing.get_args(hint) if m is not type(None)]
    return [hint]


def _type_text(hint: Any) -> str:
    """A field's type as its --help reader knows it: ``text``, ``an integer``, ``one of auto, bos, none``."""
    texts = []
    for member in _members(hint):
        origin = typing.get_origin(member)
        if origin is typing.Literal:
            texts.append("one of " + ", ".join(map(str, typing.get_args(member))))
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            texts.append("one of " + ", ".join(str(item.value) for item in member))
        elif origin is list:
            texts.append("a list of " + _type_text(typing.get_args(member)[0]))
        else:
            plain = {str: "text", bool: "true or false", int: "an integer", float: "a number", dict: "an object"}
            texts.append(plain.get(origin or member, getattr(member, "__name__", str(member))))
    return " or ".join(texts)


def as_flags(error: TaperNormError, dataclass_types: Iterable[type]) -> TaperNormError:
    """``error`` with every field name that is an option of these dataclasses written as its flag
    (``TaperNormConfig.ema_rate`` -> ``--ema_rate``; a class's ``FLAGS_OF_FIELDS`` names the flags of fields spelled
    otherwise: ``TaperNormConfig.distillation.weight`` -> ``--distill_weight``); the same class, so the exit
    status stays the same."""
    classes = list(dataclass_types)
    flags = {f.name: f.name for cls in classes for f in dataclasses.fields(cls)}
    for cls in classes:
        flags.update(getattr(cls, "FLAGS_OF_FIELDS", {}))
    text = _FIELD.sub(lambda m: f"--{flags[m[1]]}" if m[1] in flags else m[0], str(error))
    if text == str(error):
        return error
    try:
        return type(error)(text)
    except TypeError:  # an error class whose constructor takes more than the message
        return error


__all__ = ["UsageError", "as_flags", "parse"]
