"""Text corpora for continued pretraining, through `datasets`, tokenized and packed into blocks.

Sources: a Hub dataset name (online users), a local text/json/jsonl/parquet/csv file or a folder of
them, optionally streamed, or the embedded default corpus: the Python standard library's own
source files, which exist offline on every machine with Python. Documents are assigned to the
held-out split by a hash of their text, so the split does not depend on the order of the corpus,
on streaming, or on how many training blocks a run needs; blocks are cut from the concatenation of
tokenized documents (each followed by EOS), the standard packing of causal-LM pretraining.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import datasets
import torch
from tqdm.auto import tqdm

from ..errors import ConfigurationError
from .heldout import EvaluationSet, sample_blocks

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


@dataclass
class PackedData:
    """Training and held-out blocks of ``block_size`` token ids, with provenance for the report."""

    train: datasets.Dataset
    heldout: datasets.Dataset
    source: str
    block_size: int
    text_column: str
    prefix_ids: list[int] = field(default_factory=list)  # sink tokens starting every block
    heldout_set: Optional[EvaluationSet] = None  # the held-out blocks with the document of every target

    @property
    def train_tokens(self) -> int:
        return len(self.train) * self.block_size

    @property
    def heldout_tokens(self) -> int:
        return len(self.heldout) * self.block_size


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
    files = sorted(embedded_corpus_files(root), key=lambda f: _digest(f.relative_to(root).as_posix(), "order:"))
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    paths = [f.relative_to(root).as_posix() for f in files]
    logger.info("embedded corpus: %d standard-library files from %s", len(files), root)
    return datasets.Dataset.from_dict({"text": texts, "path": paths})


# ----------------------------------------------------------------------------- loading
def local_dataset_path(source: Optional[str]) -> Optional[Path]:
    """The local file or folder the dataset name ``source`` means, there or not; None for the embedded corpus and a
    Hub dataset's name. A name is a local path when it exists, starts with ``.``, ``/`` or ``~``, or ends in a data
    file's suffix (``.txt``, ``.jsonl``, ...): such a name that is not there is a mistyped path, not a Hub name, so
    every command refuses it as one (before loading a model: app/data_checks.py)."""
    if source is None or source == EMBEDDED_CORPUS:
        return None
    path = Path(source).expanduser()
    local = path.exists() or source.startswith((".", "/", "~")) or path.suffix.lower() in _BUILDERS
    return path if local else None


def local_data_files(source: Optional[str], name: Optional[str] = None) -> Optional[tuple[str, list[Path]]]:
    """The ``datasets`` builder and the files that load_text_dataset reads for the dataset name ``source`` (None: the
    embedded corpus or a Hub dataset's name): the file itself, or a folder's files of a suffix a builder reads (hidden
    files and folders, ``.ipynb_checkpoints/`` or ``.git/``, skipped as ``datasets`` skips them: they hold copies of
    the data or tool state, not more of the corpus), all of one builder.

    The loading and the check every command makes before it loads a model (app/data_checks.py) both ask this, so a
    local path the loader cannot read is refused before the model loads, for the same reason. DataError, its
    subject ``name`` (default ``dataset 'SOURCE'``; a command names its option), for a path that is not there, a
    file of a suffix no builder reads, a folder with no data file or one mixing file types. What the files hold (no
    text, not UTF-8, not a table) only the loading finds.
    """
    path = local_dataset_path(source)
    if path is None:
        return None
    name = name or f"dataset '{source}'"
    if not path.exists():
        raise DataError(f"{name} not found: no such file or folder")
    supported = f"{', '.join(sorted(_BUILDERS))} (or a folder of such files, or a Hub dataset name)"
    if not path.is_dir():
        suffix = path.suffix.lower()
        if suffix not in _BUILDERS:
            raise DataError(f"{name}: unsupported file type '{suffix or '(none)'}'; supported: {supported}")
        return _BUILDERS[suffix], [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"{name} is a folder that holds no {'/'.join(sorted(_BUILDERS))} files")
    builders = {_BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise DataError(f"{name} is a folder that mixes file types ({', '.join(sorted(builders))}); use one type")
    return builders.pop(), files


def load_text_dataset(
    source: Optional[str] = None,
    *,
    config_name: Optional[str] = None,
    split: str = "train",
    streaming: bool = False,
    sample_by: str = "paragraph",
    cache_dir: Optional[str] = None,
) -> AnyDataset:
    """Load a corpus as a `datasets` dataset of documents.

    ``source``: None or ``"python-stdlib"`` for the embedded corpus; a local file or folder
    (txt/md: one document per ``sample_by`` unit = "line" | "paragraph" | "document"; json/jsonl,
    parquet, csv: one document per row); otherwise a Hub dataset name (with ``config_name``).
    """
    if source is None or source == EMBEDDED_CORPUS:
        dataset = embedded_corpus()
        return dataset.to_iterable_dataset() if streaming else dataset
    try:
        local = local_data_files(source)
        if local is not None:
            builder, files = local
            if all(f.stat().st_size == 0 for f in files):
                what = "its files hold" if Path(source).expanduser().is_dir() else "the file holds"
                raise DataError(f"dataset '{source}' is empty: {what} no text")
            # utf-8-sig: a byte-order mark (Windows editors write one) is not text of the first document
            kwargs = {"sample_by": sample_by, "encoding": "utf-8-sig"} if builder == "text" else {}
            return datasets.load_dataset(
                builder,
                data_files=[str(f) for f in files],
                split=split,
                streaming=streaming,
                cache_dir=cache_dir,
                **kwargs,
            )
        return datasets.load_dataset(source, config_name, split=split, streaming=streaming, cache_dir=cache_dir)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types (FileNotFoundError, ArrowInvalid, HF errors)
        cause = _root_cause(error)
        if isinstance(cause, UnicodeDecodeError):
            raise DataError(
                f"dataset '{source}' is not UTF-8 text ({cause.reason} at byte {cause.start} of a file); convert it "
                "to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file"
            ) from error
        where = (
            "local file or folder" if local_dataset_path(source) is not None else "Hub dataset (offline or missing?)"
        )
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise DataError(f"could not load dataset '{source}' as a {where}: {type(cause).__name__}: {reason}") from error


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain: datasets wraps what went wrong in "An error occurred while generating"."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def load_documents(data) -> AnyDataset:
    """The documents a command's data arguments name (``--dataset_name`` and friends: cli/arguments.py)."""
    return load_text_dataset(
        data.dataset_name,
        config_name=data.dataset_config_name,
        split=data.dataset_split,
        streaming=data.streaming,
        sample_by=data.sample_by,
        cache_dir=data.data_cache_dir,
    )


def prepare_from_arguments(data, tokenizer, *, train_blocks: Optional[int], prefix_ids: Sequence[int]) -> PackedData:
    """:func:`prepare_data` on the documents and options that a command's data arguments name (``taper``, ``eval``)."""
    return prepare_data(
        load_documents(data),
        tokenizer,
        block_size=data.block_size,
        train_blocks=train_blocks,
        heldout_blocks=data.heldout_blocks,
        heldout_percentage=data.heldout_percentage,
        text_column=data.text_column,
        source=data.dataset_name or EMBEDDED_CORPUS,
        prefix_ids=prefix_ids,
        heldout_seed=data.heldout_seed,
    )


def text_column_of(dataset: AnyDataset, requested: Optional[str] = None) -> str:
    """The column holding the text: ``requested``, else ``text``, else the only string column."""
    features = dataset.features
    if features is None:  # streaming datasets may not know their features before reading
        first = next(iter(dataset))
        columns = {k: isinstance(v, str) for k, v in first.items()}
    else:
        columns = {k: getattr(v, "dtype", None) in ("string", "large_string") for k, v in features.items()}
    if requested is not None:
        if requested not in columns:
            raise DataError(f"text column '{requested}' not in the dataset; columns: {', '.join(columns)}")
        return requested
    if "text" in columns:
        return "text"
    strings = [k for k, is_text in columns.items() if is_text]
    if len(strings) == 1:
        return strings[0]
    raise DataError(
        f"cannot tell which column holds the text (columns: {', '.join(columns) or 'none'}); pass --text_column"
    )


# ----------------------------------------------------------------------------- split and packing
def _digest(text: str, salt: str = "") -> int:
    return int.from_bytes(hashlib.sha1((salt + text).encode("utf-8", errors="replace")).digest()[:8], "big")


def is_heldout(text: str, percentage: float) -> bool:
    """Deterministic document-level split: a hash of the text, independent of order and machine."""
    return (_digest(text) % 10_000) < round(percentage * 100)


def pack_documents(
    texts: Iterable[str],
    tokenizer,
    block_size: int,
    *,
    max_blocks: Optional[int] = None,
    batch_size: int = 64,
    desc: str = "packing",
    prefix_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Tokenize documents, append EOS to each, concatenate, and cut full blocks of ``block_size``.

    The tail shorter than one block is dropped. Stops reading as soon as ``max_blocks`` are full,
    so a short run on a large (or streamed) corpus tokenizes only what it uses. ``prefix_ids``
    (the attention-sink tokens, e.g. BOS) start every block, followed by ``block_size - len(prefix_ids)``
    text tokens: a model trained with a sink prefix must see it at position 0 of every sequence.
    """
    prefix = [int(i) for i in prefix_ids]
    if block_size < 2 + len(prefix):
        raise DataError(f"block_size must be at least {2 + len(prefix)} tokens, got {block_size}")
    eos = tokenizer.eos_token_id
    body = block_size - len(prefix)
    blocks: list[list[int]] = []
    buffer: list[int] = []
    progress = tqdm(total=max_blocks, desc=desc, unit="block", leave=False)
    pending: list[str] = []

    def flush() -> None:
        nonlocal buffer
        encoded = tokenizer(pending, add_special_tokens=False)["input_ids"]
        pending.clear()
        for ids in encoded:
            buffer.extend(ids)
            if eos is not None:
                buffer.append(eos)
        full = len(buffer) // body
        take = full if max_blocks is None else min(full, max_blocks - len(blocks))
        for i in range(take):
            blocks.append(prefix + buffer[i * body : (i + 1) * body])
        progress.update(take)
        buffer = buffer[full * body :]

    try:
        for text in texts:
            if max_blocks is not None and len(blocks) >= max_blocks:
                break
            if text:
                pending.append(text)
            if len(pending) >= batch_size:
                flush()
        if pending and (max_blocks is None or len(blocks) < max_blocks):
            flush()
    finally:
        progress.close()
    return blocks


def _texts(dataset: AnyDataset, column: str, *, heldout: bool, percentage: float) -> Iterator[str]:
    for _, text in _named_texts(dataset, column, heldout=heldout, percentage=percentage):
        yield text


def _named_texts(dataset: AnyDataset, column: str, *, heldout: bool, percentage: float) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of one split's documents; the name is the ``path`` column where the corpus has one."""
    for index, row in enumerate(dataset):
        text = row.get(column)
        if text is None:  # JSON rows that name their text otherwise: training on the others would skip them unsaid
            others = [k for k, v in row.items() if isinstance(v, str) and v]
            raise DataError(
                f"row {index} of the dataset has no '{column}' value"
                + (f" (it has {', '.join(others[:4])})" if others else "")
                + f": every row needs its text in '{column}'; fix the data, or pass --text_column"
            )
        if isinstance(text, str) and is_heldout(text, percentage) == heldout:
            name = row.get("path")
            yield (name if isinstance(name, str) else f"document {index}"), text


def heldout_documents(
    dataset: AnyDataset, *, percentage: float = 5.0, text_column: Optional[str] = None
) -> list[tuple[str, str]]:
    """``(name, text)`` of the documents a run holds out of ``dataset`` (by a hash of their text), in corpus order:
    the documents its held-out blocks are drawn from (``prepare_data``)."""
    column = text_column_of(dataset, text_column)
    return list(_named_texts(dataset, column, heldout=True, percentage=percentage))


def _as_dataset(blocks: list[list[int]], prefix_length: int = 0) -> datasets.Dataset:
    # With a sink prefix the first text token's prediction (made at the sink position) is not a
    # target: a folded model never computes the sink position, so no loss may depend on it.
    labels = (
        [block[:prefix_length] + [-100] + block[prefix_length + 1 :] for block in blocks] if prefix_length else blocks
    )
    dataset = datasets.Dataset.from_dict({"input_ids": blocks, "labels": labels})
    return dataset.with_format("torch")


def prepare_data(
    dataset: AnyDataset,
    tokenizer,
    *,
    block_size: int,
    train_blocks: Optional[int],
    heldout_blocks: int,
    heldout_percentage: float = 5.0,
    text_column: Optional[str] = None,
    source: str = EMBEDDED_CORPUS,
    prefix_ids: Sequence[int] = (),
    heldout_seed: int = 0,
) -> PackedData:
    """Split documents into train/held-out, tokenize and pack each into blocks (``labels = input_ids``).

    ``train_blocks``: how many training blocks to build (None: all the corpus holds; 0: none, for
    evaluation only). ``prefix_ids`` start every block (see ``pack_documents``); the label of the
    first text token is then -100. The ``heldout_blocks`` held-out blocks are drawn at random positions
    of the held-out documents with ``heldout_seed`` (``data.heldout.sample_blocks``), the same for
    every training seed. Raises ``DataError`` when a needed split cannot fill a single block.
    """
    if not 0.0 < heldout_percentage < 100.0:
        raise DataError(f"heldout_percentage must be in (0, 100), got {heldout_percentage}")
    column = text_column_of(dataset, text_column)
    try:
        heldout_set = sample_blocks(
            _named_texts(dataset, column, heldout=True, percentage=heldout_percentage),
            tokenizer,
            block_size=block_size,
            count=heldout_blocks,
            seed=heldout_seed,
            prefix_ids=prefix_ids,
            name="held-out",
            description=f"{heldout_percentage:g}% of the documents of {source}, held out by a hash of their text",
        )
    except ConfigurationError:
        heldout_set = None
    heldout = heldout_set.blocks.tolist() if heldout_set is not None else []
    train = []
    if train_blocks != 0:
        train = pack_documents(
            _texts(dataset, column, heldout=False, percentage=heldout_percentage),
            tokenizer,
            block_size,
            max_blocks=train_blocks,
            desc="training blocks",
            prefix_ids=prefix_ids,
        )
    for name, blocks in (("training", train), ("held-out", heldout)):
        if not blocks and not (name == "training" and train_blocks == 0):
            count = len(dataset) if isinstance(dataset, datasets.Dataset) else None
            few = name == "held-out" and count is not None and count < 100.0 / heldout_percentage
            raise DataError(
                f"dataset '{source}' is too small: its {name} split ({heldout_percentage:g}% of documents held "
                f"out) does not fill one block of {block_size} tokens; "
                + (
                    f"it holds only {count} document(s) and the split takes whole documents: split the text into "
                    "more (blank lines between paragraphs, or --sample_by line)"
                    if few
                    else "use more text or a smaller --block_size"
                )
            )
    if train_blocks and len(train) < train_blocks:
        logger.warning(
            "dataset '%s' holds %d training blocks of %d tokens, fewer than the %d the run reads: it will repeat",
            source,
            len(train),
            block_size,
            train_blocks,
        )
    n = len(prefix_ids)
    return PackedData(
        _as_dataset(train, n), _as_dataset(heldout, n), source, block_size, column, list(prefix_ids), heldout_set
    )


def blocks_tensor(dataset: datasets.Dataset) -> torch.Tensor:
    """All blocks of a packed dataset as one ``[n, block_size]`` tensor of token ids."""
    return torch.as_tensor(dataset.with_format("torch")[:]["input_ids"])
