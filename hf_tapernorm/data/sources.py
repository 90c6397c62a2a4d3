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

from ..errors import ConfigurationError
from ..utils import expand_user

logger = logging.getLogger(__name__)

EMBEDDED_CORPUS = "python-stdlib"
"""Name of the embedded default corpus (also accepted as ``--dataset_name``)."""

# Folder names under the standard library that are not part of the library proper (installed third-
# party packages vary between machines), hold deliberately malformed test inputs, or hold the English
# documentation that serves as the out-of-corpus reference text (data/heldout.py: pydoc_data).
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
)

_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}

AnyDataset = Union[datasets.Dataset, datasets.IterableDataset]


class DataError(ConfigurationError):
    """A dataset that cannot be used: missing, unreadable, without a text column, or too small."""


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
    local = path.exists() or source.startswith((".", "/", "~")) or path.suffix.lower() in _BUILDERS
    return path if local else None


def local_data_files(
    source: Optional[str], name: Optional[str] = None, split: Optional[str] = None
) -> Optional[tuple[str, list[Path]]]:
    """:func:`local_splits`, its files of every split in one list (what the early checks read: columns, paths)."""
    local = local_splits(source, name, split)
    return None if local is None else (local[0], [file for files in local[1].values() for file in files])


def local_splits(
    source: Optional[str], name: Optional[str] = None, split: Optional[str] = None
) -> Optional[tuple[str, dict[str, list[Path]]]]:
    """The ``datasets`` builder and, by split, the files that load_text_dataset reads for the dataset name ``source``
    and the split expression ``split`` (None: none named); None for the embedded corpus and a Hub dataset's name. The
    file itself, or a folder's files of a suffix a builder reads (hidden files and folders, ``.ipynb_checkpoints/`` or
    ``.git/``, skipped as ``datasets`` skips them: copies of the data or tool state), all of one builder. Beside
    json/parquet/csv files, ``.md`` files are notes and the folder's card, not data (``datasets`` leaves them out of a
    folder of tables too). In a folder of text files they are text like the others, but for a root README.md whose
    YAML front matter holds the metadata ``datasets`` reads from a card (``configs``, ``dataset_info``): the card of a
    git clone of a Hub text dataset.

    A file, and a folder of the user's own files (no card), are one corpus whose one split is train, whatever the
    files are named (train.md beside test_x.md, eval.jsonl beside chat.jsonl), unless the folder's file names form
    several splits as ``datasets`` reads them (train.jsonl beside test.jsonl). Such a folder, and a folder with a card
    (a README.md with front matter beside tables; such a README.md in a text folder: a copy of a Hub dataset), have
    the splits ``datasets`` resolves for them (:func:`_folder_splits`), from which ``split`` reads as datasets would
    (test, train[:10%]+test). With none named, the train split is read (a card's only split, if it has one); a folder
    without a card whose names form several splits is refused then: neither mixing the splits nor choosing one for the
    user is right. A WARNING says how many of the folder's data files that leaves out.

    The loading and the check every command makes before it loads a model (app/data_checks.py) both ask this, so a
    local path the loader cannot read is refused first, for the same reason. DataError, its subject ``name`` (default
    ``dataset 'SOURCE'``; a command names its option), for a path that is not there, a file of a suffix no builder
    reads, a folder with no data file or one mixing file types, a split it lacks. What the files hold (no text, not
    UTF-8, not a table, how many rows) only the loading finds.
    """
    name = name or f"dataset '{source}'"
    if source is not None and not source.strip():
        raise DataError(f"{name}: {_EMPTY}")
    path = local_dataset_path(source)
    if path is None:
        return None
    if not path.exists():
        raise DataError(f"{name} not found: no such file or folder")
    supported = f"{', '.join(sorted(_BUILDERS))} (or a folder of such files, or a Hub dataset name)"
    if not path.is_dir():
        suffix = path.suffix.lower()
        if suffix not in _BUILDERS:
            raise DataError(f"{name}: unsupported file type '{suffix or '(none)'}'; supported: {supported}")
        return _BUILDERS[suffix], _read_splits({"train": [path]}, [path], split, name, "a local file", False)
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    card = path / datasets.config.REPOCARD_FILENAME  # README.md
    tables = any(_BUILDERS[p.suffix.lower()] != "text" for p in files)
    if tables:  # .md beside tables: the card and notes, which datasets leaves out of a folder of tables too
        is_card = card in files and _front_matter(card) is not None
        files = [p for p in files if p.suffix.lower() != ".md"]
    else:
        is_card = card in files and any(field in (_front_matter(card) or {}) for field in _CARD_FIELDS)
        if is_card:
            files.remove(card)  # a Hub text dataset's card (a git clone of it), as datasets reads it
    if not files:
        besides = " besides its card (README.md)" if is_card else ""
        raise DataError(f"{name} is a folder that holds no {'/'.join(sorted(_BUILDERS))} files{besides}")
    builders = {_BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise DataError(f"{name} is a folder that mixes file types ({', '.join(sorted(builders))}); use one type")
    builder = builders.pop()
    corpus = "a folder read as one corpus (no dataset card, its file names forming one split at most)"
    if builder == "text" and not is_card:  # notes or source: one corpus whatever its names (train.md, test_x.md)
        return builder, _read_splits({"train": files}, files, split, name, corpus, False)
    splits = _folder_splits(path, files, card if is_card else None, name)
    if not is_card and len(splits) < 2:  # a folder of the user's own files: the names are theirs, not splits
        return builder, _read_splits({"train": files}, files, split, name, corpus, False)
    return builder, _read_splits(splits, files, split, name, None, is_card)


def _read_splits(
    splits: dict[str, list[Path]], files: list[Path], split: Optional[str], name: str, corpus: Optional[str], card: bool
) -> dict[str, list[Path]]:
    """Of a local dataset's ``splits`` (its ``files`` by split), those the split expression ``split`` reads; None: the
    train split, or a ``card``'s only split, read as train (:func:`local_splits`). ``corpus``: what the dataset is
    when it is one corpus, its one split train (a file, a folder read as one corpus); None for a folder of splits."""
    if split is None and len(splits) > 1 and not card:
        raise DataError(
            f"{name} is a folder whose file names form the splits {', '.join(splits)} (as datasets reads them): read "
            "one with --dataset_split NAME, or name the files of one (a file, or a folder holding only them) as the "
            "dataset"
        )
    if split is None and len(splits) > 1 and "train" not in splits:
        raise DataError(
            f"{name} is a folder whose files form the splits {', '.join(splits)} and no train split (as datasets "
            "reads it): read one with --dataset_split NAME, or name one split's file, or a folder of one split, as the "
            "dataset"
        )
    named = list(dict.fromkeys(_split_names(split))) if split is not None else ["train"]
    missing = [one for one in named if one not in splits] if split is not None else []
    if missing and corpus is not None:
        raise DataError(
            f"{name} is {corpus}, whose one split is train, not '{missing[0]}': name that split's file as the dataset "
            "(slices such as train[:50%] read part of train)"
        )
    if missing:
        raise DataError(
            f"{name} has no split '{missing[0]}': its splits, as datasets reads the folder, are {', '.join(splits)}; "
            "name one of them as --dataset_split"
        )
    read_as = {one: one if one in splits else next(iter(splits)) for one in named}  # a card's only split as train
    chosen = {one: splits[read_as[one]] for one in named}
    read, outside = sum(map(len, chosen.values())), set(files).difference(*splits.values())
    if read < len(files) and (split is None or outside):  # the split named leaves out the others, as asked
        what = f"'{split}'" if split is not None else f"its {read_as['train']} split"
        message = "%s: reading %s as datasets resolves the folder, %d of its %d data file(s) (its splits: %s)"
        logger.warning(message, name, what, read, len(files), ", ".join(splits))
    return chosen


#: The fields of a dataset card's YAML front matter that ``datasets`` reads from a local folder's README.md (its
#: configurations and its splits' infos): a README.md that holds one is a dataset's card, whatever its files are.
_CARD_FIELDS = (datasets.config.METADATA_CONFIGS_FIELD, "dataset_info")


def _front_matter(readme: Path) -> Optional[dict]:
    """The YAML front matter of ``readme`` (a folder's root README.md) as a mapping; None for none, or one YAML cannot
    read (a note's). A Hub dataset's card has one (its license, its configurations); a dataset card's metadata that
    ``datasets`` reads (:data:`_CARD_FIELDS`) marks a clone of a Hub text dataset, whose card must not be read as
    text nor its test split as training text."""
    from huggingface_hub import metadata_load
    from yaml import YAMLError

    try:
        return metadata_load(readme) or None
    except (ValueError, YAMLError):  # ValueError: not UTF-8, or a front matter that is no mapping
        return None


def _folder_splits(folder: Path, files: list[Path], card: Optional[Path], name: str) -> dict[str, list[Path]]:
    """A folder's data ``files`` by split, as ``datasets`` resolves a local dataset folder (LocalDatasetModuleFactory)
    with its ``card`` (README.md: a copy of a Hub dataset) or without: the data_files (or data_dir) of the default
    configuration the card declares, else the file-name conventions of ``get_data_patterns``
    (data/train-00000-of-00001.parquet beside data/test-00000-of-00001.parquet, train/ beside test/), else every file
    as train; splits that hold none of ``files`` left out. A git clone of a Hub dataset then reads as its Hub name
    does: never another configuration's files, nor files its card leaves out. Paths are compared absolute, links not
    resolved (as datasets lists them), so a ``snapshot_download`` copy, whose files are links into blobs/, reads as
    its clone does. Reads the folder only (no cache); DataError, naming ``name``, for a folder whose splits datasets
    cannot tell (an unreadable card, a configuration to choose, files its card names that are not there) or whose
    splits hold none of ``files``."""
    from datasets.data_files import DataFilesDict, get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard
    from yaml import YAMLError

    def unreadable(error: Exception) -> DataError:
        reason = (str(error).strip().splitlines() or [""])[0]
        return DataError(f"{name}: cannot tell the folder's splits as datasets reads it: {reason}")

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data) if card else MetadataConfigs()
        default = configs.get_default_config_name()
    except (ValueError, YAMLError) as error:
        raise unreadable(error) from None
    if configs and default is None:
        raise DataError(
            f"{name} is a folder whose card (README.md) declares the configurations {', '.join(configs)} and no "
            "default: name the data files of one as the dataset"
        )
    config = configs[default] if default is not None else {}
    base = Path(os.path.abspath(folder), config.get("data_dir", ""))
    try:
        if config.get("data_files") is not None:
            patterns = sanitize_patterns(config["data_files"])
        else:
            patterns = get_data_patterns(str(base))
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(base))
    except FileNotFoundError as error:  # a card's path that matches no file
        raise unreadable(error) from None
    ours = {Path(os.path.abspath(file)): file for file in files}
    splits = {str(split): sorted(ours[p] for p in map(Path, found) if p in ours) for split, found in resolved.items()}
    splits = {split: found for split, found in splits.items() if found}
    if not splits and card is not None:
        raise DataError(
            f"{name} is a folder whose splits, as datasets reads it ({'its card' if configs else 'its file names'}), "
            f"hold none of its {'/'.join(sorted(_BUILDERS))} files: name the data files as the dataset"
        )
    return splits


def load_text_dataset(
    source: Optional[str] = None,
    *,
    config_name: Optional[str] = None,
    split: Optional[str] = None,
    streaming: bool = False,
    sample_by: str = "paragraph",
    cache_dir: Optional[str] = None,
) -> AnyDataset:
    """Load a corpus as a `datasets` dataset of documents.

    ``source``: None or ``"python-stdlib"`` for the embedded corpus; a local file or folder
    (txt/md: one document per ``sample_by`` unit = "line" | "paragraph" | "document"; json/jsonl,
    parquet, csv: one document per row); otherwise a Hub dataset name (with ``config_name``). ``split``: a split
    expression (test, train[:10%]+validation); None, the default, reads the train split (:func:`local_splits` for a
    folder whose files form splits).

    The steps are those of ``datasets.load_dataset`` (its builder, ``download_and_prepare``, ``as_dataset``), with the
    rows of each split counted between the last two: a slice that selects none of them (train[100:] of 50 rows) is
    refused, where ``datasets`` would give no row and the corpus's packing would fail later.
    """
    check_split(source, split, streaming)
    if source is None or source == EMBEDDED_CORPUS:
        dataset = embedded_corpus()
        return dataset.to_iterable_dataset() if streaming else dataset
    try:
        local = local_splits(source, split=split)
        if local is not None:
            builder_name, splits = local
            if all(f.stat().st_size == 0 for files in splits.values() for f in files):
                what = "its files hold" if expand_user(source).is_dir() else "the file holds"
                raise DataError(f"dataset '{source}' is empty: {what} no text")
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
        raise _load_error(source, error) from error


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
    missing = [name for name in _split_names(split) if splits and name not in splits]
    if missing:
        raise DataError(f"dataset '{source}' has no split '{missing[0]}': its splits are {', '.join(splits)}")
    _check_selects_rows(source, split, {name: info.num_examples for name, info in (builder.info.splits or {}).items()})
    return builder


def _check_selects_rows(source: str, split: str, sizes: dict[str, int]) -> None:
    """Refuse a split expression that selects no row of the splits of ``sizes`` (name -> rows, as the dataset's
    builder records them, or counted them preparing its data), as ``datasets`` reads it (ReadInstruction.to_absolute):
    train[200:] of 150 rows. Nothing where a split it reads has no size (0): the corpus refuses an empty one."""
    names = list(dict.fromkeys(_split_names(split)))
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


def _split_names(split: str) -> list[str]:
    """The splits a split expression reads: ``train[:10%]+validation`` reads train and validation."""
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


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


def _load_error(source: str, error: BaseException) -> DataError:
    """The one-line DataError for a dataset ``datasets`` could not load. A Hub name whose first folder is here
    (``texts/corpuz``, ``texts/`` a local folder) is most likely a mistyped local path: the error says so."""
    cause = _root_cause(error)
    if isinstance(cause, UnicodeDecodeError):
        return DataError(
            f"dataset '{source}' is not UTF-8 text ({cause.reason} at byte {cause.start} of a file); convert it "
            "to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file"
        )
    reason = (str(cause).strip().splitlines() or [""])[0]
    if local_dataset_path(source) is not None:
        return DataError(
            f"could not load dataset '{source}' as a local file or folder: {type(cause).__name__}: {reason}"
        )
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


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain: datasets wraps what went wrong in "An error occurred while generating"."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def text_digest(text: str, salt: str = "") -> int:
    """A stable 64-bit hash of ``text`` (the held-out split and the embedded corpus's order: no ``hash()``, which
    changes between processes)."""
    return int.from_bytes(hashlib.sha1((salt + text).encode("utf-8", errors="replace")).digest()[:8], "big")
