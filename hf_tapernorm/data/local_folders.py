"""Which files of a local dataset folder are read, and as which splits: the rules ``datasets`` follows for a folder.

A folder's files are those of a suffix a builder reads (:data:`BUILDERS`), less what ``datasets`` skips in a data
folder (hidden files and folders; the names of its ``FILES_TO_IGNORE``: config.json, dataset_info.json, ...), and its
splits those ``datasets`` resolves for it (a card's configurations, else the file-name conventions). A folder that
``save_to_disk`` wrote is no data folder: ``datasets.load_dataset`` refuses it, and so does this. sources.local_splits
asks :func:`folder_splits` for a folder and :func:`read_splits` for a file; the loading and every command's early
check ask sources.local_splits, so the two cannot disagree.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Optional, Union

import datasets
from datasets.data_files import FILES_TO_IGNORE

from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

#: The ``datasets`` builder that reads a local file of each suffix.
BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


class DataError(ConfigurationError):
    """A dataset that cannot be used: missing, unreadable, without a text column, or too small."""


class TooLittleText(DataError):
    """A text (a split, an evaluation set) that fills no block. ``facts`` is the message without its advice, which
    names a command's options: fold reads its text as a run's report records it, and words its own."""

    def __init__(self, facts: str, advice: str) -> None:
        super().__init__(f"{facts}{advice}")
        self.facts = facts


#: What warn_once has warned of in this process.
_WARNED: set[tuple] = set()


def warn_once(key: tuple, message: str) -> None:
    """Log ``message`` as a WARNING once per process for ``key`` (what it is about: the files and the split, not
    the words naming the dataset): a command asks how a folder reads in its early check, which names the option, and
    in its loading and slice count, which do not; the user needs to be told once."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def split_names(split: str) -> list[str]:
    """The splits a split expression reads: ``train[:10%]+validation`` reads train and validation."""
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


def data_file_names(names: Iterable[str]) -> set[str]:
    """Of the relative file ``names`` of a dataset folder, those folder_splits may read as data: a builder's suffix,
    not a name ``datasets`` ignores, and no ``.md`` beside tables (notes and the card). What a run compares of its
    dataset folder on --resume: a notes file added beside the data changes no data. (A text folder's README.md is
    kept, though a card with YAML front matter is not read: which it is can change with an edit.)"""
    ignored = set(FILES_TO_IGNORE) - {datasets.config.REPOCARD_FILENAME}
    data = {name for name in names if PurePosixPath(name).suffix.lower() in BUILDERS}
    data = {name for name in data if PurePosixPath(name).name not in ignored}
    if any(BUILDERS[PurePosixPath(name).suffix.lower()] != "text" for name in data):
        data = {name for name in data if PurePosixPath(name).suffix.lower() != ".md"}
    return data


def folder_splits(
    path: Path, split: Optional[str], name: str, split_option: Optional[str] = "--dataset_split"
) -> tuple[str, dict[str, list[Path]]]:
    """The builder and, by split, the files of the folder ``path`` that the split expression ``split`` reads (None:
    none named), as sources.local_splits describes; ``name`` is the subject of its DataError. ``.md`` files beside
    json/parquet/csv files are notes and the folder's card, not data (``datasets`` leaves them out of a folder of
    tables too); in a folder of text files they are text, but for a root README.md whose YAML front matter holds the
    metadata ``datasets`` reads from a card (:data:`_CARD_FIELDS`). The other names ``datasets`` skips in a data
    folder (its ``FILES_TO_IGNORE``: config.json, dataset_info.json beside the data) are never read: a model's
    config or a cache's record is not a document. README.md is the card rule's, as .md is this package's text."""
    entries = [p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    found = sorted(p for p in entries if p.is_file() and p.suffix.lower() in BUILDERS)
    _warn_linked_folders(path, entries, name)
    _warn_compressed_files(path, entries, name)
    _refuse_saved_dataset(path, found, name)
    card = path / datasets.config.REPOCARD_FILENAME  # README.md
    ignored = set(FILES_TO_IGNORE) - {card.name}
    files = [p for p in found if p.name not in ignored]
    tables = any(BUILDERS[p.suffix.lower()] != "text" for p in files)
    if tables:  # .md beside tables: the card and notes, which datasets leaves out of a folder of tables too
        is_card = card in files and _front_matter(card) is not None
        files = [p for p in files if p.suffix.lower() != ".md"]
    else:
        is_card = card in files and any(field in (_front_matter(card) or {}) for field in _CARD_FIELDS)
        if is_card:
            files.remove(card)  # a Hub text dataset's card (a git clone of it), as datasets reads it
    if not files:
        besides = " besides its card (README.md)" if is_card else ""
        raise DataError(f"{name} is a folder that holds no {'/'.join(sorted(BUILDERS))} files{besides}")
    builders = {BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise DataError(f"{name} is a folder that mixes file types ({', '.join(sorted(builders))}); use one type")
    builder = builders.pop()
    splits = _folder_splits(path, files, card if is_card else None, name)
    if not is_card and len(splits) < 2:  # a folder of the user's own files: the names are theirs, not splits
        return builder, _read_one_corpus(path, files, splits, split, name, split_option)
    return builder, read_splits(splits, files, split, name, None, is_card, split_option)


def _read_one_corpus(
    folder: Path,
    files: list[Path],
    splits: dict[str, list[Path]],
    split: Optional[str],
    name: str,
    split_option: Optional[str],
) -> dict[str, list[Path]]:
    """A folder without a card whose file names form one split at most (``splits``, as datasets resolves them): one
    corpus, every file of it the train split, since the names are the user's (notes.jsonl beside train.jsonl is data
    too). Where datasets would read it otherwise (train.jsonl alone; test.txt alone as a test split), a WARNING says
    so, and the split its names form (test, validation) reads those files alone, as datasets would."""
    formed = next(iter(splits), None)
    if formed is None or (formed == "train" and splits[formed] == files):  # datasets reads it the same way
        corpus = "a folder read as one corpus (no dataset card, no file name forming a split)"
        return read_splits({"train": files}, files, split, name, corpus, False)
    named = split_names(split) if split is not None else ["train"]
    listed = ", ".join(str(f.relative_to(folder)) for f in splits[formed])
    if formed != "train":
        readable = f"train (every file) and {formed} ({listed})"
        unknown = next((one for one in named if one not in ("train", formed)), None)
        if unknown is not None or set(named) == {"train", formed}:
            problem = f"has no split '{unknown}'" if unknown else f"--dataset_split {split} reads {listed} twice"
            raise DataError(
                f"{name} {problem}: without a dataset card (README.md) the folder is one corpus, its splits "
                f"{readable}; name one as --dataset_split"
            )
        if formed in named:  # test.txt alone read as datasets reads it: its test split
            corpus = f"a folder whose file names form the one split {formed} (no dataset card)"
            return read_splits({formed: splits[formed]}, files, split, name, corpus, False)
    corpus = "a folder read as one corpus (no dataset card, its file names forming one split at most)"
    chosen = read_splits({"train": files}, files, split, name, corpus, False)
    if formed == "train":
        datasets_reads = f"its train split from {listed} alone. To read only those, name them as the dataset"
    else:
        datasets_reads = f"{listed} as its {formed} split, and no train split"
        if split_option:
            datasets_reads += f". {split_option} {formed} reads it so"
    readme = any(p.name == datasets.config.REPOCARD_FILENAME and p.parent == folder for p in files)
    card = (  # a README.md whose YAML names no configuration or split is text among the others, as datasets reads it
        "its README.md is no dataset card datasets reads (its YAML, if any, names no configs or splits) but text"
        if readme
        else "no dataset card (README.md)"
    )
    warn_once(
        ("one corpus", *files),
        f"{name}: {card}, so its {len(files)} data file(s) are one corpus, read as its train "
        f"split; datasets would read {datasets_reads}",
    )
    return chosen


def _warn_linked_folders(path: Path, entries: list[Path], name: str) -> None:
    """A WARNING naming the links to folders among a folder's ``entries`` (its files and folders, hidden ones left
    out): their files are not read, as ``datasets`` does not read them either (neither follows a link to a folder,
    which may loop), and a user who linked a folder in meant its text to count."""
    linked = [p for p in entries if p.is_symlink() and p.is_dir()]
    _warn_unread(
        path,
        linked,
        name,
        "linked folder(s)",
        "as datasets does not follow a link to a folder; name the "
        "folder a link points to as the dataset, or copy its files in",
    )


def _warn_unread(path: Path, unread: list[Path], name: str, kind: str, why: str) -> None:
    """One WARNING (once per process) naming the entries of the folder ``path`` that reading it skips (``unread``,
    of ``kind``), and ``why`` with what to do: without it, their text would be missing from the corpus unnoticed."""
    if unread:
        listed = sorted(p.relative_to(path).as_posix() for p in unread)
        shown = ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "")
        warn_once((kind, path, *listed), f"{name}: its {len(listed)} {kind} ({shown}) are not read, {why}")


#: The single-file compressions ``datasets`` infers from a data file's last suffix (data.jsonl.gz), each with the
#: command that decompresses it to its standard output (refuse_packed names the file it writes: gunzip, unxz and
#: bunzip2 pick that name themselves from a suffix they must know, in lower case, and lz4 writes to a pipe when not
#: run in a terminal), and the archives (:data:`ARCHIVES`), each with the command that extracts its files.
DECOMPRESS = {".gz": "gzip -dc", ".gzip": "gzip -dc", ".bz2": "bzip2 -dc", ".xz": "xz -dc", ".lz4": "lz4 -dc"}
DECOMPRESS.update({".zst": "zstd -dc", ".zstd": "zstd -dc"})
DECOMPRESS.update({".zip": "unzip", ".tar": "tar -xf", ".tar.gz": "tar -xzf", ".tgz": "tar -xzf"})
DECOMPRESS.update({".tar.bz2": "tar -xjf", ".tbz2": "tar -xjf", ".tar.xz": "tar -xJf", ".txz": "tar -xJf"})
DECOMPRESS.update({".tar.zst": "tar --zstd -xf", ".7z": "7z x"})

#: The suffixes of :data:`DECOMPRESS` that name archives: files of files, not one file compressed.
ARCHIVES = frozenset({".zip", ".tar", ".tgz", ".tbz2", ".txz", ".7z"}) | {
    s for s in DECOMPRESS if s.startswith(".tar.")
}


def shell_quoted(path: Union[Path, str]) -> str:
    """``path`` as one word of a shell command that a refusal prints, always in single quotes (a quote in it as
    shlex.quote writes one: ``'it'"'"'s/u.txt'``), so the command runs as printed whatever the path holds. A relative
    path that starts with ``-`` gets ``./`` first: quoting does not stop iconv or tar from reading ``-x16.txt`` as an
    option."""
    text = str(path)
    if text.startswith("-"):
        text = "./" + text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def unused_name(path: Path, tag: str, *, keep: bool = True) -> Path:
    """The first name that no file has of ``path`` itself (``keep``), ``NAME.TAG.SUFFIX``, ``NAME.TAG-2.SUFFIX``,
    ...: a printed command writes its output with ``>``, which would replace a file of the user's (data.txt beside
    data.txt.gz) without a word."""
    if keep and not os.path.lexists(path):
        return path
    stem, suffix = (path.stem, path.suffix) if path.suffix else (path.name, "")
    number = 1
    while os.path.lexists(candidate := path.with_name(f"{stem}.{tag}{f'-{number}' if number > 1 else ''}{suffix}")):
        number += 1
    return candidate


def packed_file(path: Path) -> Optional[str]:
    """The suffix of :data:`DECOMPRESS` (its longest) by which ``path`` is an archive (o.zip, x.tar.gz) or a
    compressed data file (data.jsonl.gz, or x.gz, whose name tells no type); None for any other file, such as
    notes.docx.bz2, whose text no builder reads compressed or not."""
    name = path.name.lower()
    suffix = max((s for s in DECOMPRESS if name.endswith(s) and len(name) > len(s)), key=len, default=None)
    if suffix is None or suffix in ARCHIVES:
        return suffix
    inner = Path(name[: -len(suffix)]).suffix
    return suffix if inner in BUILDERS or not inner else None


def refuse_packed(path: Path, name: str) -> None:
    """Refuse (DataError, its subject ``name``) an archive or a compressed data file named alone (packed_file),
    naming the command that unpacks it (a compressed file's into the file the message names). ``datasets`` reads a
    compressed file and a zip archive, but every check that reads a file before the model loads (its columns, whether
    it is empty, a lone surrogate's line) and --sample_by's rule read its bytes as the data, which they are not; the
    files it holds read as any other."""
    suffix = packed_file(path)
    if suffix is None:
        return
    command = f"{DECOMPRESS[suffix]} {shell_quoted(path)}"
    if suffix in ARCHIVES:
        raise DataError(
            f"{name}: an archive ({suffix}) is not read; extract it ({command}) and name the data file it writes, or "
            "a folder of them"
        )
    original = path.name[: -len(suffix)]
    plain = unused_name(path.parent / original, "unpacked").name
    command += f" > {shell_quoted(path.parent / plain)}"  # the name the message gives, whatever the suffix's case
    inner = Path(original).suffix.lower()  # the data's type: notes.unpacked (notes taken) is no .unpacked file
    if inner:
        raise DataError(
            f"{name}: a compressed file ({suffix}) is not read; decompress it ({command}) and name the {inner} file "
            f"it writes ('{plain}')"
        )
    raise DataError(
        f"{name}: a compressed file ({suffix}) is not read; decompress it ({command}) and name the file it writes "
        f"('{plain}') with the suffix of its type ({', '.join(sorted(BUILDERS))})"
    )


def _warn_compressed_files(path: Path, entries: list[Path], name: str) -> None:
    """A WARNING naming the archives and compressed data files among a folder's ``entries`` (packed_file):
    ``datasets`` would read some of them (a .zip, a .jsonl.gz), but the checks made before a model loads read a
    file's bytes as its data, so they are not read (one named alone is refused, refuse_packed)."""
    compressed = [p for p in entries if p.is_file() and packed_file(p)]
    _warn_unread(
        path,
        compressed,
        name,
        "compressed file(s)",
        "as the checks before loading cannot read them; "
        "decompress them in the folder (gunzip -k FILE, unzip FILE, tar -xzf FILE, ...) to read their text",
    )


def _refuse_saved_dataset(path: Path, found: list[Path], name: str) -> None:
    """Refuse a folder that ``save_to_disk`` wrote, or one holding such a folder (``found``: its files of a builder's
    suffix), told as ``datasets.load_from_disk`` tells one: a Dataset's folder holds its state.json and
    dataset_info.json, a DatasetDict's a dataset_dict.json. Read as data, those records are rows (a CastError, or a
    one-row split), and ``datasets.load_dataset`` refuses such a folder too. Not read here with ``load_from_disk``:
    its splits would bypass the split expressions, streaming and the early column and row checks that files get."""
    config = datasets.config
    saved = sorted(
        {
            p.parent
            for p in found
            if p.name == config.DATASETDICT_JSON_FILENAME
            or (p.name == config.DATASET_STATE_JSON_FILENAME and (p.parent / config.DATASET_INFO_FILENAME).is_file())
        },
        key=lambda folder: len(folder.parts),
    )
    if saved:
        where = "is" if saved[0] == path else f"holds, in '{saved[0]}',"
        raise DataError(
            f"{name} {where} a dataset that datasets' save_to_disk wrote (Arrow files and their state.json), which is "
            "read with datasets.load_from_disk, not as data files: write each split of it as a file (ds.to_json("
            "'train.jsonl'), ds.to_parquet('test.parquet')) and name that file, or a folder of them, as the dataset"
        )


def read_splits(
    splits: dict[str, list[Path]],
    files: list[Path],
    split: Optional[str],
    name: str,
    corpus: Optional[str],
    card: bool,
    split_option: Optional[str] = "--dataset_split",
) -> dict[str, list[Path]]:
    """Of a local dataset's ``splits`` (its ``files`` by split), those the split expression ``split`` reads; None: the
    train split, or a ``card``'s only split, read as train (sources.local_splits). ``corpus``: what the dataset is
    when it is one corpus, its one split train (a file, a folder read as one corpus); None for a folder of splits.
    ``split_option``: the option that names this dataset's split, which the refusals advise (None: it has none, as
    --out_of_corpus_dataset has none, so they advise naming one split's files)."""
    if split_option:
        pick = f"read one with {split_option} NAME, all of them with {split_option} {'+'.join(splits)}, or name"
    else:
        pick = "no option names a split of this dataset: name"
    if split is None and len(splits) > 1 and not card:
        raise DataError(
            f"{name} is a folder whose file names form the splits {', '.join(splits)} (as datasets reads them): "
            f"{pick} the files of one (a file, or a folder holding only them) as the dataset"
        )
    if split is None and len(splits) > 1 and "train" not in splits:
        raise DataError(
            f"{name} is a folder whose files form the splits {', '.join(splits)} and no train split (as datasets "
            f"reads it): {pick} one split's file, or a folder of one split, as the dataset"
        )
    named = list(dict.fromkeys(split_names(split))) if split is not None else ["train"]
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
        left = sorted(set(files).difference(*chosen.values()))
        names = ", ".join(file.name for file in left[:5]) + (", ..." if len(left) > 5 else "")
        warn_once(
            ("split", split, *files),
            f"{name}: reading {what} as datasets resolves the folder, {read} of its {len(files)} data file(s) (its "
            f"splits: {', '.join(splits)}; left out: {names})",
        )
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
    its clone does; none for a folder without a card in which datasets finds no data file (README.md notes). Reads the
    folder only (no cache); DataError, naming ``name``, for a folder whose splits datasets cannot tell (an unreadable
    card, a configuration to choose, files its card names that are not there) or whose splits hold none of
    ``files``."""
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
    except FileNotFoundError as error:  # a card's path that matches no file; without one, no file datasets reads
        if card is None:  # only README.md notes, or files in _old/: none is a split, the folder one corpus
            return {}
        raise unreadable(error) from None
    ours = {Path(os.path.abspath(file)): file for file in files}
    splits = {str(split): sorted(ours[p] for p in map(Path, found) if p in ours) for split, found in resolved.items()}
    splits = {split: found for split, found in splits.items() if found}
    if not splits and card is not None:
        raise DataError(
            f"{name} is a folder whose splits, as datasets reads it ({'its card' if configs else 'its file names'}), "
            f"hold none of its {'/'.join(sorted(BUILDERS))} files: name the data files as the dataset"
        )
    return splits
