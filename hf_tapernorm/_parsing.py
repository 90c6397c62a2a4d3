"""Argument parsing for every command line of the package (``hf-tapernorm``'s subcommands in cli/, the
benchmark in bench/): ``HfArgumentParser`` whose errors are one-line usage errors, whose number options refuse
NaN and infinity, whose text options refuse what no path or name can hold (a byte of argv that is not UTF-8, a
line break) and whose seeds keep to one range (utils.check_seeds), an options file read as the flags it stands for
(one parse, one set of checks, whatever the source: _options_file.py turns the file into those flags, the types of
_option_types.py check them), and the translation of field names into flag names.

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
import os
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Optional

from transformers import HfArgumentParser

from ._option_types import (
    UsageError,
    finite_float,
    hint_members,
    is_text,
    one_line_value,
    text_value,
)
from ._options_file import (
    check_options_file,
    command_line,
    is_options_file,
    note_file_paths,
    options_file_among,
    read_options_file,
    refuse_misplaced,
)
from ._options_reading import BARE_TILDE, has_a_yaml_bool_word
from .errors import ConfigurationError, TaperNormError
from .utils import BARE_TILDE_OPTIONS, check_seeds, expand_user

#: ``Class.field`` (or ``Class.group.field``) as the layers below the command line name a field in their errors.
_FIELD = re.compile(r"\b(?:TaperNormConfig|TrainingArguments)\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)")


#: A percent sign in a help text, as written (``train[:10%]``) or already escaped for argparse (transformers' own
#: help texts write ``~20%%``): both become ``%%``, which argparse prints as one percent sign.
_PERCENT = re.compile("%%?")


class _Parser(HfArgumentParser):
    """transformers' parser, with one-line errors and each field's option at hand (``options``): an options file is
    read through it as the flags it stands for (_options_file.py). Each text option's type checks that its value is
    text a path or a name can hold (``one_line_value``; a ``MULTILINE`` option's, ``text_value``: _option_types.py),
    whether the value came from argv or from a file."""

    def __init__(self, dataclass_types: Sequence[type], prog: str, source: Optional[str] = None) -> None:
        #: field name -> its argparse action (the option named after the field, not its ``--no_`` complement)
        self.options: dict[str, argparse.Action] = {}
        #: every flag as an options file may spell it (``no_private``, ``model_name_or_path``) -> its action
        self.flags: dict[str, argparse.Action] = {}
        self.source = source  # the options file being read, named in every error
        self.hints, self.separators, self.empty, self.numbers, self.multiline = _declared(dataclass_types)
        self.enum_choices = _enum_choices(dataclass_types)
        super().__init__(list(dataclass_types), prog=prog, allow_abbrev=False)  # a flag is its whole name

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        negated = kwargs.pop("negated_help", None)  # a bool field's text for its --no_ twin, which shares its help
        if negated is not None and kwargs.get("action") == "store_false":  # its option's default is the default
            kwargs.update(help=negated, default=argparse.SUPPRESS)
        if isinstance(kwargs.get("help"), str):  # argparse %-formats it: a help's % is a percent sign, never a spec
            kwargs["help"] = _PERCENT.sub("%%", kwargs["help"])
        if kwargs.get("type") is float:  # one check for every number option of every command, before any work
            kwargs["type"] = finite_float
        if kwargs.get("nargs") in ("+", "*") and "action" not in kwargs:
            kwargs["action"] = _ListItems
        action = super().add_argument(*args, **kwargs)
        if action.choices is None and action.nargs is None and action.dest in self.enum_choices:
            action.choices = self.enum_choices[action.dest]  # refused as argparse refuses a choice: option named
        if action.type is str:  # a field's option: its declared type tells a one-line text (a path, a name)
            hint = self.hints.get(action.dest)
            one_line = hint is not None and is_text(hint) and action.dest not in self.multiline
            action.type = one_line_value if one_line else text_value
        if f"--{action.dest}" in action.option_strings:
            self.options[action.dest] = action
        self.flags.update({s[2:].replace("-", "_"): action for s in action.option_strings if s.startswith("--")})
        return action

    def error(self, message: str) -> NoReturn:  # argparse would print the usage block and exit
        raise UsageError(f"{f'{self.source}: ' if self.source else ''}{message} (see {self.prog} --help)")


class _ListItems(argparse.Action):
    """A several-value option: each time it is given, its values add up, in place of its default. ``push --include
    a --include b`` includes both (argparse's own ``store`` would keep b alone, without a word), and an options
    file's list reaches the parse as one ``--option=ITEM`` per item (:func:`command_line`), so that an item is a
    value of its option whatever its first character (``--no_private`` or ``-notes.txt`` as its own word would be a
    flag). argparse still gives each item the option's type and choices."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Optional[str] = None) -> None:
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(items if items is not self.default else []), *values])


def parse(dataclass_types: Sequence[type], argv: Sequence[str], prog: str) -> tuple[Any, ...]:
    """Parse ``argv``, or one JSON/YAML file of all options (as transformers' example scripts accept).

    A file is read as the flags it stands for (:func:`command_line`) by the same argparse parse, so its values get
    the command line's types, choices and checks: ``"trust_remote_code": "false"`` is false, ``sink: bogus`` is
    refused, whatever the source. The file is the first and only argument: one named anywhere else is refused so."""
    source = argv[0] if argv and is_options_file(argv[0]) else None
    if source is not None and len(argv) > 1:  # argparse would call it an unrecognized argument
        refuse_misplaced(source, argv, prog)
    parser = _Parser(dataclass_types, prog, source)
    bare: frozenset[str] = frozenset()  # the options the file gave a bare YAML ~
    if source is not None:
        path = os.path.abspath(expand_user(source, f"options file '{source}'"))  # a quoted '~/run.json' too
        check_options_file(path, source)
        as_written = {
            flag
            for flag, action in parser.flags.items()
            if action.dest in parser.hints
            and (is_text(parser.hints[action.dest]) or action.type in (int, finite_float))
        }
        words = {flag for flag, action in parser.flags.items() if has_a_yaml_bool_word(action.choices or ())}
        values = read_options_file(path, source, as_written, words)
        argv = command_line(parser, values)
        note_file_paths(parser, path, values)  # a refusal that one of its paths is not found says where it looked
        bare = frozenset(parser.flags[key.replace("-", "_")].dest for key, v in values.items() if v is BARE_TILDE)
        required = sorted({action.dest for action in parser.flags.values() if action.required} & bare)
        if required:  # argparse would say that the option the file names is missing
            raise UsageError(
                f"{source}: {required[0]}: ~ is YAML's null, so the required --{required[0]} has no value: write '~' "
                "(quoted) if you meant the home folder"
            )
    else:
        misplaced = options_file_among(parser, argv)
        if misplaced is not None:  # argparse would read it as a flag's value (--resume run.json) or an extra word
            refuse_misplaced(misplaced, argv, prog)
    ends = [word for word in argv if word.startswith("--") and word.partition("=")[2] == "--"]
    if ends:  # argparse drops a value `--` (the end of the options): --output_dir=-- would be the list []
        where = f"{source}: " if source is not None else ""
        raise UsageError(f"{where}{ends[0]}: '--' is no value an option can take (see {prog} --help)")
    given_tilde = BARE_TILDE_OPTIONS.set((source or "", bare))
    try:  # the path options given a bare YAML ~ are refused as the dataclasses check their paths
        parsed = tuple(parser.parse_args_into_dataclasses(args=list(argv), look_for_args_file=False))  # no <prog>.args
    except ValueError as error:
        if isinstance(error, ConfigurationError):
            raise
        message = str(error)
        if message.startswith("Some specified arguments are not used"):
            unused = message.split(":", 1)[1].strip()
            raise UsageError(f"unrecognized arguments: {unused} (see {prog} --help)") from None
        raise UsageError(message) from None
    finally:
        BARE_TILDE_OPTIONS.reset(given_tilde)
    for options in parsed:  # every seed option of every command, in one range
        check_seeds(options)
    return parsed


def _declared(
    dataclass_types: Sequence[type],
) -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str], set[str]]:
    """Each option's type as declared (HfArgumentParser rewrites each Field's), and the classes' ``SEPARATORS``
    (option -> the text between the items of an option that lists several things in one value, ``--keep_norms
    a,b``), ``EMPTY`` (option -> how its flag spells an empty list, ``--report_to none``), ``NUMBERS`` (the text
    options whose text is a number, ``--taper_end 0.7``: an options file may write them as numbers) and
    ``MULTILINE`` (the text options that are prose, not a path or name, and may run over several lines: a commit
    message's body)."""
    hints, separators, empty, numbers, multiline = {}, {}, {}, set(), set()
    for cls in dataclass_types:
        declared = typing.get_type_hints(cls)
        hints.update({f.name: declared[f.name] for f in dataclasses.fields(cls) if f.init})
        separators.update(getattr(cls, "SEPARATORS", {}))
        empty.update(getattr(cls, "EMPTY", {}))
        numbers.update(getattr(cls, "NUMBERS", ()))
        multiline.update(getattr(cls, "MULTILINE", ()))
    return hints, separators, empty, numbers, multiline


def _enum_choices(dataclass_types: Sequence[type]) -> dict[str, list[str]]:
    """field name -> the values of the Enum a class declares it as, for a field whose class (or a class it derives
    from) declares it as an Enum, in whichever class of the MRO: a subclass that redeclares TrainingArguments'
    ``lr_scheduler_type: SchedulerType | str`` as ``str`` (for its own default) still takes only a SchedulerType,
    which TrainingArguments checks only after the parse, naming no option ("COSINE is not a valid SchedulerType").
    HfArgumentParser gives such a field's own Enum its choices; these give the redeclared one the same."""
    choices: dict[str, list[str]] = {}
    for cls in dataclass_types:
        for base in reversed(cls.__mro__):
            if not dataclasses.is_dataclass(base):
                continue
            declared = typing.get_type_hints(base)
            for name in base.__dict__.get("__annotations__", {}):
                kinds = [
                    m for m in hint_members(declared.get(name)) if isinstance(m, type) and issubclass(m, enum.Enum)
                ]
                if kinds:
                    choices[name] = [str(item.value) for item in kinds[0]]
    return choices


def json_object_text(option: str, value: Any) -> Any:
    """An object option's text as TrainingArguments is to read it, stripped (``' {"num_decay_steps": 3}'``): it
    json.loads only a text that starts with ``{`` and drops any other, so the run would go on without it. A text
    that is no JSON object (``--lr_scheduler_kwargs notjson``, ``[1]``) is refused; any other value is returned as
    it is."""
    if not isinstance(value, str):
        return value
    try:
        read = json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(f"{option} {value}: not a JSON object ({error})") from None
    if not isinstance(read, dict):
        raise UsageError(f"{option} {value}: not a JSON object (write one such as '{{\"key\": 1}}')")
    return value.strip()  # json.loads read past JSON's whitespace alone, which strip() removes


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
