"""An options file (``hf-tapernorm taper run.json``, ``.yaml``) read as the command line it stands for, so that its
values get the flags' types, choices and checks through the same parse (_parsing.py): where a file may stand, the
checks on the file itself, and the translation of its object into ``--option=value`` words. Its JSON or YAML is read
by _options_reading.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import stat
import typing
from collections.abc import Collection, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn, Optional, Protocol

import yaml

from ._option_types import UsageError, finite_float, hint_members, is_text, takes_a_list, type_text
from ._options_reading import BARE_TILDE, foreign_value, load_values
from .errors import TaperNormError
from .utils import expand_user

#: The options file the running command read (as named, its folder) and the relative paths it gave, by flag. A path
#: in a file is read from the working folder, as its flag would be; a refusal that it is not found says so.
_READ_FROM_FILE: ContextVar[Optional[tuple[str, str, dict[str, list[str]]]]] = ContextVar(
    "read_from_file", default=None
)


class OptionsParser(Protocol):
    """What the reading of an options file asks of the command's parser (_parsing._Parser): its flags and the
    fields' declared types, the file's name and the command's."""

    source: Optional[str]  # the options file being read, named in every error
    prog: str
    flags: dict[str, argparse.Action]  # every flag as a file may spell it -> its action
    options: dict[str, argparse.Action]  # field name -> its action
    hints: dict[str, Any]  # field name -> its declared type
    separators: dict[str, str]
    empty: dict[str, str]
    numbers: set[str]


def is_options_file(argument: str) -> bool:
    """Whether a command-line argument names an options file (run.json, RUN.YAML), not a flag or its value."""
    return not argument.startswith("-") and argument.lower().endswith((".json", ".yaml", ".yml"))


def options_file_among(parser: OptionsParser, argv: Sequence[str]) -> Optional[str]:
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
        elif taking not in ("+", "*") and is_options_file(word):
            path = expand_user(word, strict=False)  # '~/run.json', quoted, is the home folder's too
            if path.exists() and not path.is_dir():
                return word
    return None


def refuse_misplaced(options_file: str, argv: Sequence[str], prog: str) -> NoReturn:
    """Refuse a command line that names an options file and more: the file is read alone."""
    others = [word.partition("=")[0] for word in argv if word.startswith("-")]
    others = others or [word for word in argv if word != options_file]
    raise UsageError(
        f"the options file {options_file} is read alone, as the first and only argument: put {' '.join(others)} "
        f"into it, or pass every option as a flag (see {prog} --help)"
    )


def check_options_file(path: str, name: str) -> None:
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


def read_options_file(path: str, name: str, as_written: Collection[str], words: Collection[str]) -> dict[str, Any]:
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


def command_line(parser: OptionsParser, values: dict[str, Any]) -> list[str]:
    """The command line an options file stands for: ``--key=value`` for each key (null: the option left at its
    default), so that a value is one, whatever its first character. A key is any flag of the command, spelled with
    ``_`` or ``-`` (``no_private: true`` is ``--no_private``). A list gives a several-value option its values, each
    as its own ``--key=item`` (_parsing._ListItems adds them up), and a one-value option its items joined by its
    separator, or its one element where its field takes a list (:func:`takes_a_list`); any other list for a one-value
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
            item = next((typing.get_args(m)[0] for m in hint_members(hint) if typing.get_origin(m) is list), Any)
            argv += [f"--{name}={_as_text(v, key, item, action, parser)}" for v in value]
        elif name in separators or (len(value) == 1 and takes_a_list(hint)):
            items = [_as_text(v, key, hint, action, parser) for v in value]
            argv.append(f"--{name}={separators.get(name, '').join(items)}")
        else:
            bare = len(value) == 1 and not isinstance(value[0], (list, dict))  # [[16]]: no brackets to drop
            got = "a one-item list: write the item without the brackets" if bare else f"the list {value!r}"
            raise UsageError(f"{parser.source}: {key} takes one value, got {got} (see {parser.prog} --help)")
    return argv


def _refuse_foreign(value: Any, key: str, hint: Any, parser: OptionsParser) -> None:
    """Refuse an options file's value that holds what no option takes and argv cannot carry (a YAML set, ordered
    pairs, binary data, a tagged date: _options_reading.foreign_value), naming the file and the option."""
    found = foreign_value(value)
    if found is not None:
        raise UsageError(
            f"{parser.source}: {key} takes {type_text(hint)}, got {found}, which no option takes: write it as text, "
            "a number, true or false, a list or an object"
        )


def _as_bool(value: Any, key: str, action: argparse.Action, parser: OptionsParser) -> bool:
    """The value of a flag that takes none (``no_private``), read as its option's bool (true, no, 1, ...)."""
    try:
        return value if isinstance(value, bool) else bool(action.type(str(value)))
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        raise UsageError(
            f"{parser.source}: {key} takes true or false, got {value!r} (see {parser.prog} --help)"
        ) from None


def _as_text(value: Any, key: str, hint: Any, action: argparse.Action, parser: OptionsParser) -> str:
    """One value of an options file as the command line writes it: bools as true/false and objects as JSON text
    where the field's type takes them (a bool, a dict), and numbers as numbers however the file wrote them
    (``"max_steps": 2e1`` for an integer option is 20). A bool, a number or an object for an option of another type
    (``"output_dir": true`` would be a folder named true, ``1e1`` one named 10.0), a list in a list, text that is no
    number, or a fraction for an integer option, is refused naming the option; so is a null item in a list, which a
    file can carry and argv cannot (YAML's other types were refused before: :func:`_refuse_foreign`). Text goes to
    the option's own type, which refuses what no path or name can hold (:func:`text_value`) whatever the source."""
    name = parser.source
    if value is None:  # an item of a list (an option's own null is its default): `[null]` would be the text None
        raise UsageError(f"{name}: {key} holds an empty item (null): remove it, or write the value")
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and is_text(hint)
        and action.dest not in parser.numbers
    ):
        written = getattr(value, "text", repr(value))  # a YAML number for a text option is its text already
        raise UsageError(f'{name}: {key} takes text, got the number {written}; write it as text: "{written}"')
    members = hint_members(hint)
    takes = {
        bool: Any in members or bool in members,
        dict: Any in members or any(m is dict or typing.get_origin(m) is dict for m in members),
        list: False,  # a list inside the file's list
    }
    kind = next((kind for kind in takes if isinstance(value, kind)), None)
    if kind is not None and not takes[kind]:
        raise UsageError(
            f"{name}: {key} takes {type_text(hint)}, got {json.dumps(value)}; write it as the command line "
            f"does (see {parser.prog} --help)"
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    if action.type in (int, finite_float) and isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{name}: {key} must be a number, got {value!r}") from None
        if action.type is finite_float:
            return str(value)
        if not number.is_integer():
            raise UsageError(f"{name}: {key} must be an integer, got {value!r}")
        return value if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else str(int(number))
    return str(value)


#: The options whose values are paths (each command's arguments check them by name: utils.expand_user_options), the
#: only ones whose relative values an options file gives :func:`with_file_path_hint` speaks of: a Hub repository
#: (push's --repo_id) or a scheduler's name that is not found is no path looked for in the working folder.
PATH_OPTIONS = frozenset(
    {
        "model_name_or_path",
        "dataset_name",
        "out_of_corpus_dataset",
        "data_cache_dir",
        "baseline_from",
        "output_dir",
        "output_json",
        "scan_reference",
        "checkpoint",
        "export_dir",
    }
)


def note_file_paths(parser: OptionsParser, path: str, values: dict[str, Any]) -> None:
    """Note the options file being read (``path``; parser.source as named) and the relative paths it gives (each
    text value of a path option, :data:`PATH_OPTIONS`, a list's items too, that is no absolute path nor ``~``), for
    :func:`with_file_path_hint`."""
    paths: dict[str, list[str]] = {}
    for key, value in values.items():
        name = parser.flags[key.replace("-", "_")].dest
        if name not in PATH_OPTIONS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item and not _absolute(item):
                paths.setdefault(f"--{name}", []).append(item)
    _READ_FROM_FILE.set((parser.source or path, os.path.dirname(path), paths))


def _absolute(path: str) -> bool:
    """Whether ``path`` is read from no working folder: absolute, or the home folder's (``~``)."""
    return os.path.isabs(path) or path.startswith("~")


@contextlib.contextmanager
def file_paths_noted() -> Iterator[None]:
    """A command's scope for :func:`note_file_paths`: nothing is noted when it begins, and its notes end with it (a
    second command in the same process reads its own file, or none)."""
    token = _READ_FROM_FILE.set(None)
    try:
        yield
    finally:
        _READ_FROM_FILE.reset(token)


def with_file_path_hint(error: TaperNormError) -> TaperNormError:
    """``error``, where it quotes a relative path an options file gave (``'corpus.txt'``) that does not exist from
    the working folder, however it goes on (``not found``, ``no such folder``, taken as a Hub id), saying that the
    path came from the file and was looked for in the working folder, not the file's: the file reads exactly as the
    same flags, so a path in it is written from the working folder, which a user who keeps the file beside its data
    would not guess (a Hub id the file meant is from the file too: the hint is true either way). Any other error as
    it is. One place for every refusal of a missing path."""
    noted = _READ_FROM_FILE.get()
    if noted is None:
        return error
    name, folder, paths = noted
    message = str(error)
    for flag, values in paths.items():
        for value in values:
            if f"'{value}'" not in message or os.path.lexists(value):
                continue
            hinted = copy.copy(error)
            hinted.args = (_hinted(message, flag, value, name, folder),)
            return hinted
    return error


def _hinted(message: str, flag: str, value: str, name: str, folder: str) -> str:
    """``message`` saying that ``value`` (``flag``'s in the options file ``name``, in ``folder``) was looked for in
    the working folder: "'X' not found" reads "'X' (from FILE) not found in the working folder CWD", any other
    wording is kept and the hint follows it."""
    files = f"not the file's ({folder}): write them from the working folder, or as absolute paths"
    quoted = f"'{value}'"
    found = re.search(rf"{re.escape(quoted)} not found(?=$|[:;])", message)
    if found is None:
        named = quoted if flag in message[: message.index(quoted)] else f"{flag} {quoted}"
        return (
            f"{message}; {named} came from {name}: paths in an options file are read from the working folder "
            f"({os.getcwd()}), {files}"
        )
    source = f"from {name}" if flag in message[: found.start()] else f"{flag} in {name}"
    return (
        f"{message[: found.start()]}{quoted} ({source}) not found in the working folder {os.getcwd()}"
        f"{message[found.end() :]}; paths in an options file are read from the working folder, {files}"
    )


__all__ = [
    "OptionsParser",
    "PATH_OPTIONS",
    "check_options_file",
    "command_line",
    "file_paths_noted",
    "is_options_file",
    "note_file_paths",
    "options_file_among",
    "read_options_file",
    "refuse_misplaced",
    "with_file_path_hint",
]
