"""Where a corpus's documents come from: the embedded default corpus, a local file or folder, or a Hub dataset.

The embedded corpus is the Python standard library's own source files, which exist offline on every machine with
Python. A local path is read by the ``datasets`` builder its suffix names (txt/md: one document per line,
paragraph or file; json/jsonl, parquet, csv: one per row); any other name is a Hub dataset's. The rule that
tells them apart and lists a local dataset's files (:func:`local_data_files`) and the resolution of a Hub name
(:func:`hub_dataset_builder`) are what every command asks before it loads a model, so a dataset the loading would
refuse is refused first, in the loading's own words.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sysconfig
from pathlib import Path
from typing import Optional, Union

import datasets

from ..errors import main_thread_ended
from ..utils import expand_user
from .file_contents import first_not_utf8, foreign_encoding, holds_no_rows, holds_text, lone_surrogate, nul_bytes
from .local_folders import (
    BUILDERS,
    DataError,
    folder_splits,
    read_splits,
    refuse_packed,
    shell_quoted,
    split_names,
    unused_name,
)

logger = logging.getLogger(__name__)

EMBEDDED_CORPUS = "python-stdlib"
"""Name of the embedded default corpus (also accepted as ``--dataset_name``)."""

DEFAULT_SAMPLE_BY = "paragraph"
"""How local text files (the ``text`` builder's) are cut into documents unless ``--sample_by`` says otherwise; every
other dataset is one document per row (the embedded corpus: per file), whatever it says (data_checks refuses it)."""

# Folder names under the standard library that are not part of the library proper (installed third-
# party packages vary between machines), hold deliberately malformed test inputs, or hold the English
# documentation that serves as the out-of-corpus reference text (data/heldout.py: pydoc_data).
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
)

AnyDataset = Union[datasets.Dataset, datasets.IterableDataset]


# ----------------------------------------------------------------------------- the embedded corpus
def stdlib_directory() -> Path:
    """The running interpreter's standard library folder (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_corpus_files(root: Optional[Path] = None) -> list[Path]:
    """The standard library's ``.py`` files in sorted order (tests and third-party packages excluded)."""
    root = Path(root) if root is not None else stdlib_directory()
    if not root.is_dir():
        raise DataError(f"the embedded corpus needs the Python standard library sources, but {root} is not a folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"no .py files found under {root} for the embedded corpus")
    return files


def embedded_corpus(root: Optional[Path] = None) -> datasets.Dataset:
    """The embedded default corpus: one document per standard-library source file, in a fixed shuffled order.

    Real, varied text (code, comments, docstrings) that every Python installation carries, so the
    default run needs no download; the same Python version gives the same corpus on any machine. The
    files are ordered by a hash of their path, not alphabetically: a short run reads its blocks from the
    first documents, and sorted files would give it (and its held-out blocks) a few modules of one
    alphabetical stretch instead of a sample of the library.
    """
    root = Path(root) if root is not None else stdlib_directory()
    files = sorted(embedded_corpus_files(root), key=lambda f: text_digest(f.relative_to(root).as_posix(), "order:"))
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    paths = [f.relative_to(root).as_posix() for f in files]
    logger.info("embedded corpus: %d standard-library files from %s", len(files), root)
    return datasets.Dataset.from_dict({"text": texts, "path": paths})


# ----------------------------------------------------------------------------- loading
_EMPTY = "an empty name names no file, folder or Hub dataset; leave the option out for the embedded corpus, or name one"


def local_dataset_path(source: Optional[str]) -> Optional[Path]:
    """The local file or folder the dataset name ``source`` means, there or not; None for the embedded corpus and a
    Hub dataset's name. A name is a local path when it exists, starts with ``.``, ``/`` or ``~``, or ends in a data
    file's suffix (``.txt``, ``.jsonl``, ...): such a name that is not there is a mistyped path, not a Hub name, so
    every command refuses it as one (before loading a model: app/data_checks.py)."""
    if source is None or source == EMBEDDED_CORPUS:
        return None
    if not source.strip():  # Path("") is the working folder: its files would be read in the default's name
        raise DataError(f"dataset {source!r}: {_EMPTY}")
    path = expand_user(source, f"dataset '{source}'")
    local = path.exists() or source.startswith((".", "/", "~")) or path.suffix.lower() in BUILDERS
    return path if local else None


def local_data_files(
    source: Optional[str],
    name: Optional[str] = None,
    split: Optional[str] = None,
    split_option: Optional[str] = "--dataset_split",
) -> Optional[tuple[str, list[Path]]]:
    """:func:`local_splits`, its files of every split in one list (what the early checks read: columns, paths)."""
    local = local_splits(source, name, split, split_option)
    return None if local is None else (local[0], [file for files in local[1].values() for file in files])


def local_splits(
    source: Optional[str],
    name: Optional[str] = None,
    split: Optional[str] = None,
    split_option: Optional[str] = "--dataset_split",
) -> Optional[tuple[str, dict[str, list[Path]]]]:
    """The ``datasets`` builder and, by split, the files that load_text_dataset reads for the dataset name ``source``
    and the split expression ``split`` (None: none named); None for the embedded corpus and a Hub dataset's name. The
    file itself, or a folder's files of a suffix a builder reads (hidden files and folders, ``.ipynb_checkpoints/`` or
    ``.git/``, and the names ``datasets`` skips in a data folder, config.json or dataset_info.json, skipped as it skips
    them), all of one builder (local_folders.folder_splits: which .md files are notes or a card). A folder that
    ``save_to_disk`` wrote is refused: ``datasets.load_from_disk`` reads it, not a builder.

    A file, and a folder of the user's own files (no card), are one corpus whose one split is train, whatever the
    files are named (eval.jsonl beside chat.jsonl), unless the folder's file names form several splits as ``datasets``
    reads them (train.jsonl beside test.jsonl, train.txt beside test.txt); where datasets would read it otherwise
    (train.jsonl beside notes.jsonl: train.jsonl alone; test.txt alone: a test split), a WARNING says so, and the split
    the names form reads its files alone (local_folders). Such a folder, and a folder with a card (a
    README.md with front matter beside tables; such a README.md in a text folder: a copy of a Hub dataset), have the
    splits ``datasets`` resolves for them, from which ``split`` reads as datasets would (test, train[:10%]+test). With
    none named, the train split is read (a card's only split, if it has one); a folder without a card whose names
    form several splits is refused then: neither mixing the splits nor choosing one for the user is right (train+test
    reads them all). A WARNING says how many of the folder's data files that leaves out.

    The loading and the check every command makes before it loads a model (app/data_checks.py) both ask this, so a
    local path the loader cannot read is refused first, for the same reason. DataError, its subject ``name`` (default
    ``dataset 'SOURCE'``; a command names its option), for a path that is not there, a file of a suffix no builder
    reads, a folder with no data file or one mixing file types, a split it lacks. What the files hold (no text, not
    UTF-8, not a table, how many rows) only the loading finds. ``split_option``: the option that names the dataset's
    split, which a refusal advises (None where none does: --out_of_corpus_dataset, bench's text).
    """
    name = name or f"dataset '{source}'"
    if source is not None and not source.strip():
        raise DataError(f"{name}: {_EMPTY}")
    path = local_dataset_path(source)
    if path is None:
        return None
    if not path.exists():
        raise DataError(f"{name} not found: no such file or folder")
    supported = f"{', '.join(sorted(BUILDERS))} (or a folder of such files, or a Hub dataset name)"
    if not path.is_dir():
        suffix = path.suffix.lower()
        refuse_packed(path, name)
        if suffix not in BUILDERS:
            raise DataError(f"{name}: unsupported file type '{suffix or '(none)'}'; supported: {supported}")
        return BUILDERS[suffix], read_splits({"train": [path]}, [path], split, name, "a local file", False)
    return folder_splits(path, split, name, split_option)


def _check_contents(name: str, source: str, builder: str, files: list[Path]) -> None:
    """Refuse (DataError, its subject ``name``) a local dataset whose ``files`` hold nothing to read, or a file of
    them in another encoding than UTF-8 that its byte-order mark tells, before a builder reads them."""
    path = expand_user(source)
    _check_not_empty(name, path.is_dir(), builder, files)
    if builder != "parquet":
        _check_utf8_mark(name, path if path.is_dir() else None, files)
        _check_no_nul(name, path if path.is_dir() else None, files)


def _check_not_empty(name: str, folder: bool, builder: str, files: list[Path]) -> None:
    """Refuse a local dataset whose ``files`` hold nothing to read: no byte, or text files of white space alone (a
    byte-order mark first), no text; tables with no row (file_contents.holds_no_rows: white space alone too).
    ``datasets`` tells them in its own words ("Instruction train corresponds to no data", "SchemaInferenceError:
    Please pass `features`", pandas' "No columns to parse from file"), or reads one blank document, "too small"."""
    what = "its files hold" if folder else "the file holds"
    if all(f.stat().st_size == 0 for f in files) or (builder == "text" and not any(map(holds_text, files))):
        raise DataError(f"{name} is empty: {what} no text")
    if holds_no_rows(builder, files):
        raise DataError(f"{name} is empty: {what} no rows")


def _check_utf8_mark(name: str, folder: Optional[Path], files: list[Path]) -> None:
    """Refuse a file of ``files`` (those of ``folder``; None: the file named alone) whose byte-order mark says it is
    UTF-16 or UTF-32 text (file_contents.foreign_encoding), naming it and the iconv command that converts it: read
    as UTF-8 it fails at its first byte, and the advice for other text (from latin1) would mangle it."""
    found = foreign_encoding(files)
    if found is None:
        return
    path, encoding = found
    told = f"{encoding} text (told by its byte-order mark), not UTF-8"
    _refuse_encoding(name, folder, path, encoding, told)


def _check_no_nul(name: str, folder: Optional[Path], files: list[Path]) -> None:
    """Refuse a file of ``files`` whose first or last chunk holds NUL bytes as other text or binary data does
    (file_contents.nul_bytes): UTF-16 or UTF-32 text without a byte-order mark (ASCII or not), or binary data. NUL
    is valid UTF-8, so the builders read it without a word, as text with a NUL between its characters (or as too
    little text, no line or paragraph telling)."""
    found = nul_bytes(files)
    if found is None:
        return
    path, encoding, places, text_end, at_the_latest = found
    if encoding is not None:
        told = f"{encoding.upper()} text without a byte-order mark (NUL {places}), not UTF-8"
        _refuse_encoding(name, folder, path, encoding, told)
    what = f"its file '{path.relative_to(folder)}'" if folder is not None else "it"
    if text_end is not None:  # UTF-8 text, then another encoding's (cat a.txt b16.txt): no iconv converts it whole
        where = f"in its first {text_end} bytes, then holds NUL bytes from byte {text_end}"
        if at_the_latest:  # the scan for the first NUL stopped short of it
            where = f"at its start, then holds NUL bytes by byte {text_end} at the latest"
        raise DataError(
            f"{name}: {what} is UTF-8 text {where} "
            "(text in another encoding, or binary data): split that part off or convert it alone to UTF-8"
            + (", or move the file out of the folder" if folder is not None else ", and name the UTF-8 text")
        )
    raise DataError(
        f"{name}: {what} holds NUL bytes, so it is not UTF-8 text (binary data, or text in another encoding): "
        "name a UTF-8 text file" + (", or move it out of the folder" if folder is not None else "")
    )


def _refuse_encoding(name: str, folder: Optional[Path], path: Path, encoding: str, told: str) -> None:
    """Refuse ``path`` (of ``folder``; None: the file named alone), ``told`` to be text in ``encoding`` (iconv's
    name of it), naming the iconv command that converts it, its paths quoted for the shell."""
    converted = unused_name(path, "utf8", keep=False)
    command = f"iconv -f {encoding.lower()} -t utf-8 {shell_quoted(path)} > {shell_quoted(converted)}"
    if folder is None:
        raise DataError(f"{name} is {told}: convert it ({command}) and name the file it writes")
    kind = encoding.upper().removesuffix("LE").removesuffix("BE")
    raise DataError(
        f"{name}: its file '{path.relative_to(folder)}' is {told}: convert it ({command}) and move the {kind} "
        "file out of the folder"
    )


def load_text_dataset(
    source: Optional[str] = None,
    *,
    config_name: Optional[str] = None,
    split: Optional[str] = None,
    streaming: bool = False,
    sample_by: str = DEFAULT_SAMPLE_BY,
    cache_dir: Optional[str] = None,
    split_option: Optional[str] = "--dataset_split",
    name: Optional[str] = None,
) -> AnyDataset:
    """Load a corpus as a `datasets` dataset of documents.

    ``source``: None or ``"python-stdlib"`` for the embedded corpus; a local file or folder
    (txt/md: one document per ``sample_by`` unit = "line" | "paragraph" | "document"; json/jsonl,
    parquet, csv: one document per row); otherwise a Hub dataset name (with ``config_name``). ``split``: a split
    expression (test, train[:10%]+validation); None, the default, reads the train split (:func:`local_splits` for a
    folder whose files form splits; ``split_option``, the option a refusal advises). ``name``: the subject of a local
    dataset's refusals, as local_splits takes it (default ``dataset 'SOURCE'``; a command names its option,
    ``--out_of_corpus_dataset 'PATH'``, as its early checks do).

    The steps are those of ``datasets.load_dataset`` (its builder, ``download_and_prepare``, ``as_dataset``), with the
    rows of each split counted between the last two: a slice that selects none of them (train[100:] of 50 rows) is
    refused, where ``datasets`` would give no row and the corpus's packing would fail later.
    """
    check_split(source, split, streaming)
    if source is None or source == EMBEDDED_CORPUS:
        dataset = embedded_corpus()
        return dataset.to_iterable_dataset() if streaming else dataset
    files: list[Path] = []
    try:
        local = local_splits(source, name, split=split, split_option=split_option)
        if local is not None:
            builder_name, splits = local
            files = [f for chosen in splits.values() for f in chosen]
            _check_contents(name or f"dataset '{source}'", source, builder_name, files)
            # utf-8-sig: a byte-order mark (Windows editors write one) is not text of the first document
            kwargs = {"sample_by": sample_by, "encoding": "utf-8-sig"} if builder_name == "text" else {}
            data_files = {name: [str(f) for f in files] for name, files in splits.items()}
            builder = datasets.load_dataset_builder(builder_name, data_files=data_files, cache_dir=cache_dir, **kwargs)
        else:
            builder = hub_dataset_builder(source, config_name, split, cache_dir)
        split = split or "train"
        if streaming:
            return builder.as_streaming_dataset(split=split)
        builder.download_and_prepare()
        _check_selects_rows(source, split, {name: info.num_examples for name, info in builder.info.splits.items()})
        return builder.as_dataset(split=split)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types (FileNotFoundError, ArrowInvalid, HF errors)
        raise _load_error(source, error, files, name) from error


def hub_dataset_builder(
    source: str, config_name: Optional[str] = None, split: Optional[str] = None, cache_dir: Optional[str] = None
) -> datasets.DatasetBuilder:
    """The ``datasets`` builder of the Hub dataset ``source``, its data not yet read (``datasets.load_dataset_builder``,
    then ``download_and_prepare`` and ``as_dataset``: the steps of ``datasets.load_dataset``): what the loading reads
    and what every command resolves before it loads a model (app/data_checks.py), so a name the Hub lacks, a
    configuration or split the dataset lacks, or a dataset missing from the cache offline is refused first. ``split``:
    a split expression; None, its train split.

    A file loader's own name (``text``, ``json``, ``csv``, ...) is refused: with no files named, ``datasets`` reads
    every file under the working folder, whatever they are, in a dataset's name."""
    try:
        builder = datasets.load_dataset_builder(source, config_name, cache_dir=cache_dir)
    except Exception as error:  # as in load_text_dataset
        raise _load_error(source, error) from error
    if builder.repo_id is None:
        raise DataError(
            f"dataset '{source}' is the name of a datasets file loader, not of a Hub dataset: with no files named it "
            f"would read every file under the working folder; name the file or folder itself ('./{source}' for a "
            "local one) or a Hub dataset"
        )
    split = split or "train"
    splits = sorted(builder.info.splits or ())
    missing = [name for name in split_names(split) if splits and name not in splits]
    if missing:
        raise DataError(f"dataset '{source}' has no split '{missing[0]}': its splits are {', '.join(splits)}")
    _check_selects_rows(source, split, {name: info.num_examples for name, info in (builder.info.splits or {}).items()})
    return builder


def _check_selects_rows(source: str, split: str, sizes: dict[str, int]) -> None:
    """Refuse a split expression that selects no row of the splits of ``sizes`` (name -> rows, as the dataset's
    builder records them, or counted them preparing its data), as ``datasets`` reads it (ReadInstruction.to_absolute):
    train[200:] of 150 rows. Nothing where a split it reads has no size (0): the corpus refuses an empty one."""
    names = list(dict.fromkeys(split_names(split)))
    if not all(sizes.get(name) for name in names):
        return
    try:
        empty = all(part.to <= part.from_ for part in _read_instruction(split).to_absolute(sizes))
    except ValueError:  # pct1_dropremainder of a split under 100 rows, which datasets refuses as always empty
        empty = True
    if empty:
        rows = ", ".join(f"{name} {sizes[name]}" for name in names)
        raise DataError(
            f"dataset '{source}': '{split}' selects no row of its splits (rows: {rows}); name a slice within them, "
            "or the split whole"
        )


def check_split(source: Optional[str], split: Optional[str], streaming: bool = False) -> None:
    """Refuse a split expression that the loading of ``source`` would not read as written: a slice of a streamed
    dataset (``datasets`` streams whole splits), any split of the embedded corpus (read whole), a slice that selects no
    row whatever the split's size (train[3:3]). None (no split named) reads the train split. A Hub dataset's splits,
    and their sizes, are its builder's (hub_dataset_builder); a local dataset's, those of its files (local_splits)."""
    if split is None:
        return
    _read_instruction(split)
    if streaming and "[" in split:
        raise DataError(f"a streamed dataset is read whole, split by split: drop the slice of '{split}' or --streaming")
    if source is None or source == EMBEDDED_CORPUS:
        if split != "train":
            raise DataError(f"the embedded corpus is read whole, as one split (train), not '{split}'")
        return
    if _selects_nothing(split):
        raise DataError(
            f"'{split}' selects no row: a slice [start:end] reads the rows from start up to end (a negative one "
            "counts from the split's end; an end of 0 is its start), and this one ends where it starts or before; "
            "name one that ends after it starts (train[:10%], train[100:200]) or the split whole"
        )


def _read_instruction(split: str) -> datasets.ReadInstruction:
    """The split expression ``split`` as ``datasets`` parses it; DataError for one it cannot parse."""
    try:
        return datasets.ReadInstruction.from_spec(split)
    except ValueError:
        raise DataError(
            f"'{split}' is no split a dataset can be read by: a split's name (train, validation), a slice of it "
            "(train[:10%], train[100:200]), or several joined by + (no spaces)"
        ) from None


#: A part of a split expression that datasets.ReadInstruction parsed, sliced: its start and end (None: left out).
_SLICE = re.compile(r"[^\[]*\[(?P<start>-?[\d_]+)?%?:(?P<end>-?[\d_]+)?%?\].*")


def _selects_nothing(split: str) -> bool:
    """Whether the split expression ``split`` (parsed already) selects no row whatever the sizes of its splits:
    every part a slice that ends at the split's start (an end of 0, -0 or 0%: datasets counts an end of 0 from the
    start, train[-5:0] and train[:-0] included) or at or before its start, both counted from the same end of the
    split (train[3:3], train[5:2], train[-2:-5]: a left-out start is the split's start). Whether the ends of
    train[-5:5] or train[200:] meet depends on the split's size: the loading counts it (load_text_dataset), and
    hub_dataset_builder reads it where the dataset records it."""
    for part in re.split(r"\s*\+\s*", split):
        match = _SLICE.fullmatch(part)
        if match is None or match["end"] is None:
            return False
        start, end = int(match["start"] or 0), int(match["end"])
        if end != 0 and ((start < 0) != (end < 0) or end > start):
            return False
    return True


def _load_error(
    source: str, error: BaseException, files: Optional[list[Path]] = None, name: Optional[str] = None
) -> DataError:
    """The one-line DataError for a dataset ``datasets`` could not load (``files``: the local files it read; ``name``:
    the subject, default ``dataset 'SOURCE'``). A Hub name whose first folder is here (``texts/corpuz``, ``texts/`` a
    local folder) is most likely a mistyped local path: the error says so."""
    name = name or f"dataset '{source}'"
    if (ended := main_thread_ended()) is not None:  # a command in a worker thread: loaders' pools refuse to start
        return DataError(f"could not load {name}: {ended}")
    cause = _root_cause(error)
    surrogate = lone_surrogate(files) if files and "surrogate" in str(cause) else None
    if surrogate is not None:
        return DataError(
            f"{name}: {surrogate}, half of a UTF-16 surrogate pair, which is no character and which "
            "pyarrow's JSON reader refuses; fix or remove that escape"
        )
    if isinstance(cause, UnicodeDecodeError):
        return _not_utf8(name, source, cause, files or [])
    reason = (str(cause).strip().splitlines() or [""])[0]
    if isinstance(cause, OverflowError) and str(source).lower().endswith(".csv"):
        return DataError(
            f"{name} has a CSV column of digits too long for a number, which is how the csv loader "
            "types a column whose cells are all digits; write the texts as JSON Lines strings "
            '({"text": "..."} per line) instead'
        )
    if local_dataset_path(source) is not None:
        return DataError(f"could not load {name} as a local file or folder: {type(cause).__name__}: {reason}")
    here = [folder for folder in Path(source).parents if folder != Path(".") and folder.is_dir()]
    mistyped = (
        f" ('{here[0]}' is a local folder, but it holds no '{Path(source).relative_to(here[0])}': a local path is "
        "read as one when it exists or starts with ./)"
        if here
        else ""
    )
    return DataError(
        f"could not load dataset '{source}' as a Hub dataset (offline or missing?){mistyped}: "
        f"{type(cause).__name__}: {reason}"
    )


def _not_utf8(name: str, source: str, cause: UnicodeDecodeError, files: list[Path]) -> DataError:
    """The refusal of a local dataset that is not UTF-8 text, naming the file of ``files`` that is not and where
    (file_contents.first_not_utf8; ``cause``, the builder's error, which names no file, where none is found)."""
    found = first_not_utf8(files)
    folder = expand_user(source)
    where = f"{cause.reason} at byte {cause.start} of a file"
    subject = f"{name} is"
    if found is not None:
        path, offset, reason = found
        where = f"{reason} at byte {offset}"
        if folder.is_dir():
            subject = f"{name}: its file '{path.relative_to(folder)}' is"
    return DataError(
        f"{subject} not UTF-8 text ({where}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file"
    )


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain: datasets wraps what went wrong in "An error occurred while generating". A
    pyarrow error ends it: the json builder re-raises pyarrow's error from the handler of its pandas fallback, so the
    error it holds as context is the fallback's failure (pandas' "Trailing data"), not its cause."""
    import pyarrow as pa

    seen = {id(error)}
    while (
        not isinstance(error, pa.ArrowException)
        and (inner := error.__cause__ or error.__context__) is not None
        and id(inner) not in seen
    ):
        seen.add(id(inner))
        error = inner
    return error


def text_digest(text: str, salt: str = "") -> int:
    """A stable 64-bit hash of ``text`` (the held-out split and the embedded corpus's order: no ``hash()``, which
    changes between processes)."""
    return int.from_bytes(hashlib.sha1((salt + text).encode("utf-8", errors="replace")).digest()[:8], "big")
