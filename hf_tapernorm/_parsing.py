"""Argument parsing for every command line of the package (``hf-tapernorm``'s subcommands in cli/, the
benchmark in bench/): ``HfArgumentParser`` whose errors are one-line usage errors, whose number options refuse
NaN and infinity, whose text options refuse what no path or name can hold (a byte of argv that is not UTF-8, a
line break) and whose seeds keep to one range (utils.check_seeds), an options file read as the flags it stands for
(one parse, one set of checks, whatever the source; its JSON or YAML is read by _options_reading.py), and the
translation of field names into flag names.

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
import stat
import types
import typing
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NoReturn, Optional, Union

import yaml
from transformers import HfArgumentParser

from ._options_reading import BARE_TILDE, foreign_value, has_a_yaml_bool_word, load_values
from .errors import ConfigurationError, TaperNormError
from .utils import BARE_TILDE_OPTIONS, check_seeds, expand_user

#: ``Class.field`` (or ``Class.group.field``) as the layers below the command line name a field in their errors.
_FIELD = re.compile(r"\b(?:TaperNormConfig|TrainingArguments)\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)")


#: A percent sign in a help text, as written (``train[:10%]``) or already escaped for argparse (transformers' own
#: help texts write ``~20%%``): both become ``%%``, which argparse prints as one percent sign.
_PERCENT = re.compile("%%?")


class UsageError(ConfigurationError):
    """A usage error reported as one line on stderr (exit status 2), without a traceback."""


class _Parser(HfArgumentParser):
    """transformers' parser, with one-line errors and each field's option at hand (``options``): an options file is
    read through it as the flags it stands for. Each text option's type checks that its value is text a path or a
    name can hold (:func:`_text`, :func:`_one_line`; a ``MULTILINE`` option's, text: :func:`_text`), whether the
    value came from argv or from a file."""

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
        if isinstance(kwargs.get("help"), str):  # argparse %-formats it: a help's % is a percent sign, never a spec
            kwargs["help"] = _PERCENT.sub("%%", kwargs["help"])
        if kwargs.get("type") is float:  # one check for every number option of every command, before any work
            kwargs["type"] = _finite_float
        if kwargs.get("nargs") in ("+", "*") and "action" not in kwargs:
            kwargs["action"] = _ListItems
        action = super().add_argument(*args, **kwargs)
        if action.choices is None and action.nargs is None and action.dest in self.enum_choices:
            action.choices = self.enum_choices[action.dest]  # refused as argparse refuses a choice: option named
        if action.type is str:  # a field's option: its declared type tells a one-line text (a path, a name)
            hint = self.hints.get(action.dest)
            one_line = hint is not None and _is_text(hint) and action.dest not in self.multiline
            action.type = _one_line if one_line else _text
        if f"--{action.dest}" in action.option_strings:
            self.options[action.dest] = action
        self.flags.update({s[2:].replace("-", "_"): action for s in action.option_strings if s.startswith("--")})
        return action

    def error(self, message: str) -> NoReturn:  # argparse would print the usage block and exit
        raise UsageError(f"{f'{self.source}: ' if self.source else ''}{message} (see {self.prog} --help)")


class _ListItems(argparse.Action):
    """A several-value option: each time it is given, its values add up, in place of its default. ``push --include
    a --include b`` includes both (argparse's own ``store`` would keep b alone, without a word), and an options
    file's list reaches the parse as one ``--option=ITEM`` per item (:func:`_command_line`), so that an item is a
    value of its option whatever its first character (``--no_private`` or ``-notes.txt`` as its own word would be a
    flag). argparse still gives each item the option's type and choices."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Optional[str] = None) -> None:
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(items if items is not self.default else []), *values])


def _text(value: str) -> str:
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


def _one_line(value: str) -> str:
    """The type of an option whose declared type is text (a path, a name, a pattern): :func:`_text` on one line. A
    line break is any character ``str.splitlines`` breaks at (``\\n``, ``\\r``, U+2028, NEL, ...); a YAML block
    scalar ends with one."""
    breaks = [character for character in _text(value) if character.splitlines() != [character]]
    if breaks:
        raise argparse.ArgumentTypeError(
            f"{value!r} holds a line break ({breaks[0]!r}), which a path or name cannot hold: write it on one line"
        )
    return value


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
    refused, whatever the source. The file is the first and only argument: one named anywhere else is refused so."""
    source = argv[0] if argv and _is_options_file(argv[0]) else None
    if source is not None and len(argv) > 1:  # argparse would call it an unrecognized argument
        _refuse_misplaced(source, argv, prog)
    parser = _Parser(dataclass_types, prog, source)
    bare: frozenset[str] = frozenset()  # the options the file gave a bare YAML ~
    if source is not None:
        path = os.path.abspath(expand_user(source, f"options file '{source}'"))  # a quoted '~/run.json' too
        _check_options_file(path, source)
        as_written = {
            flag
            for flag, action in parser.flags.items()
            if action.dest in parser.hints
            and (_is_text(parser.hints[action.dest]) or action.type in (int, _finite_float))
        }
        words = {flag for flag, action in parser.flags.items() if has_a_yaml_bool_word(action.choices or ())}
        values = _read_options_file(path, source, as_written, words)
        argv = _command_line(parser, values)
        bare = frozenset(parser.flags[key.replace("-", "_")].dest for key, v in values.items() if v is BARE_TILDE)
    else:
        misplaced = _options_file_among(parser, argv)
        if misplaced is not None:  # argparse would read it as a flag's value (--resume run.json) or an extra word
            _refuse_misplaced(misplaced, argv, prog)
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


def _is_options_file(argument: str) -> bool:
    """Whether a command-line argument names an options file (run.json, RUN.YAML), not a flag or its value."""
    return not argument.startswith("-") and argument.lower().endswith((".json", ".yaml", ".yml"))


def _options_file_among(parser: _Parser, argv: Sequence[str]) -> Optional[str]:
    """The first argument after a flag that names an existing options file and that is no option's value: not the
    value of an option that takes one (``--output_json results.json``) or several (``--include a.json``), but after a
    flag that takes none or may take a bool (``--resume run.json``), or after another option's value."""
    taking: Any = 0  # how the option before takes values: None (one), "+" / "*" (several), else none
    for word in argv:
        if word.startswith("-"):
            flag, equals, _ = word.lstrip("-").partition("=")
            action = parser.flags.get(flag.replace("-", "_")) if word.startswith("--") else None
            if action is None and word.startswith("--"):
                return None  # an unknown flag: argparse names it
            taking = action.nargs if action is not None and not equals else 0
        elif taking is None:
            taking = 0
        elif taking not in ("+", "*") and _is_options_file(word):
            path = expand_user(word, strict=False)  # '~/run.json', quoted, is the home folder's too
            if path.exists() and not path.is_dir():
                return word
    return None


def _refuse_misplaced(options_file: str, argv: Sequence[str], prog: str) -> NoReturn:
    """Refuse a command line that names an options file and more: the file is read alone."""
    others = [word.partition("=")[0] for word in argv if word.startswith("-")]
    others = others or [word for word in argv if word != options_file]
    raise UsageError(
        f"the options file {options_file} is read alone, as the first and only argument: put {' '.join(others)} "
        f"into it, or pass every option as a flag (see {prog} --help)"
    )


def _check_options_file(path: str, name: str) -> None:
    """Refuse an options file that is missing or is no regular file, without opening it (a pipe nobody writes to
    would block the read)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"options file '{name}' not found") from None
    except OSError as error:
        raise UsageError(f"options file '{name}': cannot read it ({error.strerror})") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"options file '{name}' is a folder; name a JSON or YAML file of options")
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"options file '{name}' is not a regular file (a pipe, a socket or a device); name a JSON or YAML file "
            "of options"
        )


def _read_options_file(path: str, name: str, as_written: Collection[str], words: Collection[str]) -> dict[str, Any]:
    """The object of an options file (JSON or YAML, read by _options_reading.load_values: ``as_written`` are the
    options whose value is their text as written, ``words`` those whose plain ``no`` is the word, not false), or a
    UsageError naming the file. A leading byte order mark (what some editors write into UTF-8) is no part of the
    text."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            values = load_values(handle, path.lower().endswith(".json"), as_written, words)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError, RecursionError) as error:  # deep: recursion
        raise UsageError(
            f"{name}: cannot read it ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from None
    if not isinstance(values, dict):
        raise UsageError(f"{name}: an options file holds one object of option names and values")
    return values


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
                kinds = [m for m in _members(declared.get(name)) if isinstance(m, type) and issubclass(m, enum.Enum)]
                if kinds:
                    choices[name] = [str(item.value) for item in kinds[0]]
    return choices


def _is_text(hint: Any) -> bool:
    """Whether an option's values are text (a path, a name, a choice of words; or a list of them), not numbers."""
    members = [typing.get_args(m)[0] if typing.get_origin(m) is list else m for m in _members(hint)]
    return all(
        m is str or (typing.get_origin(m) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(m)))
        for m in members
    )


def _command_line(parser: _Parser, values: dict[str, Any]) -> list[str]:
    """The command line an options file stands for: ``--key=value`` for each key (null: the option left at its
    default), so that a value is one, whatever its first character. A key is any flag of the command, spelled with
    ``_`` or ``-`` (``no_private: true`` is ``--no_private``). A list gives a several-value option its values, each
    as its own ``--key=item`` (:class:`_ListItems` adds them up), and a one-value option its items joined by its
    separator, or its one element where its field takes a list (:func:`_takes_a_list`); any other list for a one-value
    option is refused. An empty list is the option's empty value: its flag's spelling of one
    (``EMPTY``), else no value, the option's default as with null (a several-value option whose default is not
    empty cannot be empty: refused as on the command line). Keys that are no option are refused together, named;
    so are two keys of one option (``seq_lens`` and ``seq-lens``, ``private`` and ``no_private``)."""
    hints, separators, empty = parser.hints, parser.separators, parser.empty
    texts = [key for key in values if not isinstance(key, str)]
    if texts:  # YAML reads `1:` or `~:` as a number or null
        raise UsageError(f"{parser.source}: option names are text, got {texts[0]!r} (see {parser.prog} --help)")
    flags = {key: parser.flags.get(key.replace("-", "_")) for key in values}  # --model-name-or-path is a flag too
    unknown = [key for key, action in flags.items() if action is None or action.dest not in hints]
    if unknown:
        raise UsageError(f"{parser.source}: unknown options {unknown} (see {parser.prog} --help)")
    spellings: dict[str, list[str]] = {}
    for key, action in flags.items():
        spellings.setdefault(action.dest, []).append(key)
    twice = next((keys for keys in spellings.values() if len(keys) > 1), None)
    if twice is not None:  # a list's items would add up; one value would silently win
        raise UsageError(f"{parser.source}: {' and '.join(twice)} are the same option: keep one")
    argv: list[str] = []
    for key, value in values.items():
        value = None if value is BARE_TILDE else value  # null; a path option refuses it (utils.expand_user_options)
        flag = flags[key]
        name = flag.dest
        action, hint = parser.options[name], hints[name]
        _refuse_foreign(value, key, hint, parser)
        if flag is not action and flag.nargs == 0 and value is not None:  # --no_private: true sets it, false not
            value = flag.const if _as_bool(value, key, action, parser) else not flag.const
        if value == [] and name in empty:
            value = empty[name]
        if value is None or (value == [] and not (action.nargs in ("+", "*") and action.default)):
            continue
        if value == []:  # argparse's refusal: "expected at least one argument"
            argv.append(f"--{name}")
        elif not isinstance(value, list):
            argv.append(f"--{name}={_as_text(value, key, hint, action, parser)}")
        elif action.nargs in ("+", "*"):
            item = next((typing.get_args(m)[0] for m in _members(hint) if typing.get_origin(m) is list), Any)
            argv += [f"--{name}={_as_text(v, key, item, action, parser)}" for v in value]
        elif name in separators or (len(value) == 1 and _takes_a_list(hint)):
            items = [_as_text(v, key, hint, action, parser) for v in value]
            argv.append(f"--{name}={separators.get(name, '').join(items)}")
        else:
            bare = len(value) == 1 and not isinstance(value[0], (list, dict))  # [[16]]: no brackets to drop
            got = "a one-item list: write the item without the brackets" if bare else f"the list {value!r}"
            raise UsageError(f"{parser.source}: {key} takes one value, got {got} (see {parser.prog} --help)")
    return argv


def _refuse_foreign(value: Any, key: str, hint: Any, parser: _Parser) -> None:
    """Refuse an options file's value that holds what no option takes and argv cannot carry (a YAML set, ordered
    pairs, binary data, a tagged date: _options_reading.foreign_value), naming the file and the option."""
    found = foreign_value(value)
    if found is not None:
        raise UsageError(
            f"{parser.source}: {key} takes {_type_text(hint)}, got {found}, which no option takes: write it as text, "
            "a number, true or false, a list or an object"
        )


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
    where the field's type takes them (a bool, a dict), and numbers as numbers however the file wrote them
    (``"max_steps": 2e1`` for an integer option is 20). A bool, a number or an object for an option of another type
    (``"output_dir": true`` would be a folder named true, ``1e1`` one named 10.0), a list in a list, text that is no
    number, or a fraction for an integer option, is refused naming the option; so is a null item in a list, which a
    file can carry and argv cannot (YAML's other types were refused before: :func:`_refuse_foreign`). Text goes to
    the option's own type, which refuses what no path or name can hold (:func:`_text`) whatever the source."""
    name = parser.source
    if value is None:  # an item of a list (an option's own null is its default): `[null]` would be the text None
        raise UsageError(f"{name}: {key} holds an empty item (null): remove it, or write the value")
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and _is_text(hint)
        and action.dest not in parser.numbers
    ):
        written = getattr(value, "text", repr(value))  # a YAML number for a text option is its text already
        raise UsageError(f'{name}: {key} takes text, got the number {written}; write it as text: "{written}"')
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


def _takes_a_list(hint: Any) -> bool:
    """Whether a one-value option's field takes a list too (Trainer's ``report_to: [wandb]``, as its configs write
    it): a one-item list is then its item. A list for any other one-value option (``block_size: [16]``) is refused."""
    return any(typing.get_origin(member) is list for member in _members(hint))


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
