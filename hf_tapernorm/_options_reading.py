"""How the text of an options file reads (``hf-tapernorm CMD run.json``): JSON numbers with the text the file
holds, YAML with YAML 1.2's numbers, and the value of a text or number option as its text as written. _options_file.py
turns what this reads into the command line it stands for; this module knows the two syntaxes only.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Collection
from typing import IO, Any, Optional

import yaml


def load_values(
    handle: IO[str], json_syntax: bool, as_written: Collection[str], words_as_written: Collection[str] = ()
) -> Any:
    """What an open options file holds (JSON when ``json_syntax``, else YAML): JSON numbers keep the text the file
    holds (:class:`_Written`); YAML reads numbers as YAML 1.2 does (:class:`_Loader`), and the value of a text or
    number option (``as_written``: a folder, a dataset name, a step count) is its text as written, given to the
    option's own type as the flag's text is: ``output_dir: 010`` is the folder 010, ``learning_rate: 0x10`` is
    refused as ``--learning_rate 0x10`` is; an option written as a bare ``~`` is :data:`BARE_TILDE`, not ``None``.
    ``words_as_written``: the options among whose choices is a word YAML 1.1 reads as a bool (``save_strategy``'s
    ``no``): their plain ``no`` is the text written, as ``--save_strategy no`` is, not false.
    The syntaxes' own errors (ValueError, yaml.YAMLError, RecursionError) pass to the caller, which names the file."""
    if json_syntax:
        return json.load(
            handle, parse_int=_JsonInt.read, parse_float=_JsonFloat.read, object_pairs_hook=_object_of_distinct_keys
        )
    loader = _Loader(handle)
    try:
        node = loader.get_single_node()
        if node is not None:
            _refuse_an_expansion_past(MAX_VALUES, node)
        values = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    if isinstance(values, dict) and isinstance(node, yaml.MappingNode):
        for key, value in node.value:  # merge keys already flattened into it; the last of a key wins
            if isinstance(key.value, str) and key.value.replace("-", "_") in as_written:
                values[key.value] = _as_written(value, values[key.value])
            if isinstance(key.value, str) and key.value.replace("-", "_") in words_as_written:
                values[key.value] = _word_as_written(value, values[key.value])
            if key.value in values and value.tag == _NULL and value.value == "~":  # values' key: text, not `1:`
                values[key.value] = BARE_TILDE
    return values


#: The most values (scalars, lists, mappings) an options file may hold once its YAML aliases are expanded: far more
#: than any command's options need, far fewer than a few hundred bytes of aliases of aliases can expand to.
MAX_VALUES = 10_000


def _refuse_an_expansion_past(limit: int, root: yaml.Node) -> None:
    """Refuse a YAML document whose aliases (``*name``, each the value its anchor ``&name`` marks) expand to more than
    ``limit`` values, before anything is built: aliases of aliases multiply at each level, and the object, its
    checks and its flags would take more time and memory than the machine has. Counted over the composed nodes,
    which an alias shares, so the count costs one visit per distinct node (a node inside itself counts as too many)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = limit + 1  # until it is counted: a node that holds itself expands without end
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(key) + size(value) for key, value in node.value)
        else:
            total = 1
        sizes[id(node)] = min(total, limit + 1)
        return sizes[id(node)]

    if size(root) > limit:
        raise ValueError(
            f"its YAML aliases (*name) expand to more than {limit} values, more than any command's options hold: "
            "write the values out, or alias fewer"
        )


class _BareTilde:
    """The value of an option that a YAML options file wrote as a bare ``~``: YAML's null, which leaves an option at
    its default as ``null`` does, but which, for a path option, its writer surely meant as the home folder (the
    caller refuses it there)."""

    def __repr__(self) -> str:
        return "~"


#: An option's bare YAML ``~`` (:class:`_BareTilde`), told apart from ``null`` and an empty value.
BARE_TILDE = _BareTilde()

#: The tag of YAML's null (``~``, ``null``, an empty value).
_NULL = "tag:yaml.org,2002:null"


def _refuse_repeated_key(keys: list[Any]) -> None:
    """A key given twice in one object: JSON and YAML parsers keep the last without a word, and which of the two the
    user meant is theirs to say (as two spellings of one option are refused by the parser)."""
    seen = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"the key '{key}' is given twice in one object: keep one")
        seen.add(key)


def _object_of_distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, its keys each given once (:func:`_refuse_repeated_key`)."""
    _refuse_repeated_key([key for key, _ in pairs])
    return dict(pairs)


class _Written:
    """A number of a JSON options file with the text the file holds (``text``): a text option given a number is
    refused quoting what the file says (``1e1``, ``1.50``), not Python's reading of it (``10.0``, ``1.5``)."""

    text = ""

    @classmethod
    def read(cls, text: str) -> Any:
        number = cls(text)
        number.text = text
        return number


class _JsonInt(_Written, int):
    """An integer of a JSON options file, with its text."""


class _JsonFloat(_Written, float):
    """A fraction of a JSON options file, with its text."""


#: The types YAML resolves a scalar to that may have been meant as text (``010``, ``0x1F``, ``!!timestamp``).
_NUMBER_TAGS = {f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "timestamp")}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core schema for numbers: ``010`` is 10, ``0x1F`` 31, ``1e3`` 1000.0,
    and ``1:30``, ``0b11``, ``1_000`` and ``2024-01-02`` are text, where YAML 1.1 reads 8, 90, 3, 1000 and a date.
    It is how a value inside an object option reads (``lr_scheduler_kwargs: {num_decay_steps: 010}``: 10, as its
    flag's JSON ``10`` would); an option's own value is its text as written (:func:`_as_written`). A key given twice
    in one mapping is refused (:func:`_refuse_repeated_key`); one a merge key (``<<``) brings in may be given again
    by the mapping itself, but not by a second merge (:meth:`flatten_mapping`).
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        _refuse_repeated_key(
            [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE]
        )
        return super().construct_mapping(node, deep=deep)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Merge what ``node``'s merge keys (``<<``) bring in, refusing a key that two merged mappings both give
        (``<<: [{k: 1}, {k: 2}]``, or two ``<<`` keys): YAML keeps the first merge's value, PyYAML the last or the
        first depending on how the key's text was made, without a word. Each merged mapping is flattened first, so
        that its keys are all there (PyYAML flattens it then too: a flattened node holds no merge key, so a second
        call changes nothing)."""
        merged: set[Any] = set()
        for key, value in node.value:
            if key.tag != _MERGE:
                continue
            for source in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                if not isinstance(source, yaml.MappingNode):
                    continue  # PyYAML refuses it: only mappings merge
                self.flatten_mapping(source)
                given = {item.value for item, _ in source.value if isinstance(item, yaml.ScalarNode)}
                if given & merged:
                    repeated = min(given & merged)
                    raise ValueError(f"the key '{repeated}' is given by two merges (<<) into one object: keep one")
                merged |= given
        super().flatten_mapping(node)


#: The tag of YAML's merge key (``<<``).
_MERGE = "tag:yaml.org,2002:merge"


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 integer: decimal whatever its leading zeros (``010`` is 10), ``0o`` octal, ``0x`` hexadecimal."""
    text = loader.construct_scalar(node)
    if text[:2] in ("0o", "0x"):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text)


_Loader.add_constructor("tag:yaml.org,2002:int", _core_int)


def _as_written(node: yaml.Node, value: Any) -> Any:
    """``value`` (YAML's reading of ``node``) with every number or date in it as the text the file holds; but
    YAML's own spellings of infinity and NaN (``.inf``, ``.nan``), which no flag has, stay numbers, to be refused
    as not finite."""
    if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS:
        return value if isinstance(value, float) and not math.isfinite(value) else node.value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        return [_as_written(item, v) for item, v in zip(node.value, value)]
    return value


#: The tag of YAML's bools (YAML 1.1's plain yes/no/true/false/on/off, in any of three cases).
_BOOL = "tag:yaml.org,2002:bool"

#: The words YAML 1.1 reads as bools, in lower case.
_BOOL_WORDS = {"yes", "no", "true", "false", "on", "off"}


def has_a_yaml_bool_word(choices: Collection[Any]) -> bool:
    """Whether an option's ``choices`` hold a word YAML 1.1 reads as a bool (``--save_strategy no``): its plain YAML
    value is then read as the word written (``words_as_written`` of :func:`load_values`)."""
    return any(str(choice) in _BOOL_WORDS for choice in choices)


def _word_as_written(node: yaml.Node, value: Any) -> Any:
    """``value`` with every plain (unquoted) scalar YAML read as a bool as the word the file holds: ``no`` is the
    choice ``no``, where YAML 1.1 reads false; ``NO`` stays ``NO``, refused as ``--save_strategy NO`` is."""
    if isinstance(node, yaml.ScalarNode) and node.tag == _BOOL and node.style is None and isinstance(value, bool):
        return node.value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        return [_word_as_written(item, v) for item, v in zip(node.value, value)]
    return value


#: YAML's other types, as a refusal names them: no option takes them, and str() would make each text nobody wrote.
_FOREIGN = {
    set: "a set (!!set)",
    tuple: "ordered pairs (!!omap or !!pairs)",
    bytes: "binary data (!!binary)",
    datetime.date: "a date (!!timestamp)",  # datetime.datetime too
}


def foreign_value(value: Any) -> Optional[str]:
    """What ``value`` (an option's, as :func:`load_values` read it) holds that is no text, number, bool, null, list
    or object, in words (``a set (!!set)``), or None. YAML's tags make them (``!!set``, ``!!omap``, ``!!binary``, an
    explicit ``!!timestamp`` where it is not an option's text as written), and str() would give an option text that
    nobody wrote: ``output_json: !!set {r.json: null}`` wrote a file named ``{'r.json'}``. Lists' items and objects'
    keys and values are looked into too."""
    if value is None or value is BARE_TILDE or isinstance(value, (str, int, float)):  # bool is an int
        return None
    if isinstance(value, (list, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return next((found for found in map(foreign_value, items) if found is not None), None)
    return next((words for kind, words in _FOREIGN.items() if isinstance(value, kind)), f"a {type(value).__name__}")


__all__ = ["BARE_TILDE", "foreign_value", "has_a_yaml_bool_word", "load_values"]
