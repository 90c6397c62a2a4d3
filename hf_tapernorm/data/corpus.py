"""Documents tokenized and packed into blocks for continued pretraining and evaluation, through `datasets`.

Documents come from sources.py (the embedded corpus, a local file or folder, a Hub dataset). Documents are
assigned to the held-out split by a hash of their text, so the split does not depend on the order of the corpus,
on streaming, or on how many training blocks a run needs; blocks are cut from the concatenation of tokenized
documents (each followed by EOS), the standard packing of causal-LM pretraining.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import datasets
import torch
from tqdm.auto import tqdm

from .columns import choose_text_column, string_columns
from .heldout import EvaluationSet, sample_blocks
from .local_folders import TooLittleText
from .sources import EMBEDDED_CORPUS, AnyDataset, DataError, load_text_dataset, text_digest

logger = logging.getLogger(__name__)


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


# ----------------------------------------------------------------------------- a command's documents
def load_documents(data) -> AnyDataset:
    """The documents a command's data arguments name (``--dataset_name`` and friends: cli/arguments.py)."""
    return load_text_dataset(
        data.dataset_name,
        config_name=data.dataset_config_name,
        split=data.dataset_split,
        streaming=data.streaming,
        sample_by=data.sample_by,
        cache_dir=data.data_cache_dir,
        name=f"--dataset_name '{data.dataset_name}'" if data.dataset_name is not None else None,
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
        what=f"--dataset_name '{data.dataset_name}'" if data.dataset_name is not None else None,
    )


def text_column_of(dataset: AnyDataset, requested: Optional[str] = None, option: str = "--text_column") -> str:
    """The column holding the text: ``requested`` (given by ``option``), else ``text``, else the only string column
    (columns.choose_text_column: the rule every command checks before it loads a model)."""
    features = dataset.features
    if features is None:  # streaming datasets may not know their features before reading
        first = next(iter(dataset))
        columns = {k: isinstance(v, str) for k, v in first.items()}
    else:
        columns = string_columns(features)
    return choose_text_column(columns, requested, option=option)  # every type known: a column or a DataError


# ----------------------------------------------------------------------------- split and packing


def is_heldout(text: str, percentage: float) -> bool:
    """Deterministic document-level split: a hash of the text, independent of order and machine."""
    return (text_digest(text) % 10_000) < round(percentage * 100)


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


def _texts(dataset: AnyDataset, column: str, *, heldout: bool, percentage: float, what: str) -> Iterator[str]:
    for _, text in _named_texts(dataset, column, heldout=heldout, percentage=percentage, what=what):
        yield text


def _named_texts(
    dataset: AnyDataset, column: str, *, heldout: bool, percentage: float, what: str = "the dataset"
) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of one split's documents; the name is the ``path`` column where the corpus has one.
    ``what``: the dataset, in a refusal of a row (row_text)."""
    empty = empty_cells_read_as_none(dataset)
    for index, row in enumerate(dataset):
        text = row_text(row, index, column, empty_cell=empty, what=what)
        if is_heldout(text, percentage) == heldout:
            name = row.get("path")
            yield (name if isinstance(name, str) else f"document {index}"), text


def empty_cells_read_as_none(dataset: AnyDataset) -> bool:
    """Whether ``dataset`` is read from CSV files (the csv builder, streaming or not), whose empty cell ``datasets``
    gives as None (pandas reads it as NaN): in a CSV an empty cell and a missing value are one thing, so such a text
    cell is an empty document, as a JSONL row's "" is, where a JSON row's null is a row without its text."""
    return getattr(getattr(dataset, "info", None), "builder_name", None) == "csv"


def row_text(
    row: Mapping[str, Any],
    index: int,
    column: str,
    option: str = "--text_column",
    *,
    empty_cell: bool = False,
    what: str = "the dataset",
) -> str:
    """The text of the dataset's row number ``index``, its ``column`` value (``option`` names the column). A row
    without one (JSON rows that name their text otherwise), or whose value is not text (a list, a number, an object:
    ``datasets`` reads such a column as JSON), is refused: skipping it, the corpus would train and score on the other
    rows without a word. ``empty_cell``: the rows are a CSV's (empty_cells_read_as_none), whose None is an empty
    cell, so an empty document. ``what``: the dataset (``dataset 'PATH'``), which a refusal names; it advises
    ``option`` only where the row holds text in another column, which the option could name."""
    text = row.get(column)
    if text is None and empty_cell:
        return ""
    if text is None:
        others = [k for k, v in row.items() if isinstance(v, str) and v]
        raise DataError(
            f"row {index} of {what} has no '{column}' value"
            + (f" (it has {', '.join(others[:4])})" if others else "")
            + f": every row needs its text in '{column}'; fix the data"
            + (f", or pass {option}" if others else "")
        )
    if not isinstance(text, str) and empty_cell:  # a CSV: its loader typed the column by its cells
        raise DataError(
            f"row {index} of '{column}' is {_kind(text)}, not text: the csv loader types a column whose cells all "
            f"read as numbers or true/false so, quoted or not; write the texts as JSON Lines strings, or pass {option}"
        )
    if not isinstance(text, str):
        raise DataError(
            f"row {index} of '{column}' is {_kind(text)}, not text: every row needs its text in '{column}' as a "
            f"string; fix the data, or pass {option}"
        )
    return text


def _kind(value: object) -> str:
    """What a JSON value that is not a string is, in a message (a list, a number, an object)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    return f"a {type(value).__name__}"


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
    train_repeats: bool = True,
    what: Optional[str] = None,
) -> PackedData:
    """Split documents into train/held-out, tokenize and pack each into blocks (``labels = input_ids``).

    ``train_blocks``: how many training blocks to build (None: all the corpus holds; 0: none, for
    evaluation only). ``prefix_ids`` start every block (see ``pack_documents``); the label of the
    first text token is then -100. The ``heldout_blocks`` held-out blocks are drawn at random positions
    of the held-out documents with ``heldout_seed`` (``data.heldout.sample_blocks``), the same for
    every training seed; ``heldout_blocks=0``: no held-out split, every document trains (bench's train mode, which
    measures speed). Raises ``DataError`` when a needed split cannot fill a single block. ``train_repeats``: the
    reader goes over the training blocks again when they are fewer than ``train_blocks`` (taper's Trainer: a WARNING
    says so); False where the caller refuses so short a split itself (bench's train mode), which no WARNING precedes.
    ``what``: the dataset in a refusal of a row (row_text), a command's option and its value (``--dataset_name
    'PATH'``); default ``dataset 'SOURCE'``.
    """
    if not 0.0 < heldout_percentage < 100.0:
        raise DataError(f"heldout_percentage must be in (0, 100), got {heldout_percentage}")
    column = text_column_of(dataset, text_column)
    what = what or f"dataset '{source}'"
    heldout_set = None
    if not heldout_blocks:
        heldout_percentage = 0.0  # is_heldout holds out no document
    else:
        texts = _named_texts(dataset, column, heldout=True, percentage=heldout_percentage, what=what)
        description = f"{heldout_percentage:g}% of the documents of {source}, held out by a hash of their text"
        heldout_set = _heldout_set(texts, tokenizer, block_size, heldout_blocks, heldout_seed, prefix_ids, description)
    heldout = heldout_set.blocks.tolist() if heldout_set is not None else []
    train = []
    if train_blocks != 0:
        train = pack_documents(
            _texts(dataset, column, heldout=False, percentage=heldout_percentage, what=what),
            tokenizer,
            block_size,
            max_blocks=train_blocks,
            desc="training blocks",
            prefix_ids=prefix_ids,
        )
    for name, blocks in (("training", train), ("held-out", heldout)):
        if (
            not blocks
            and not (name == "training" and train_blocks == 0)
            and not (name == "held-out" and not heldout_blocks)
        ):
            raise _too_little_text(dataset, column, source, name, heldout_percentage, block_size)
    if train_repeats and train_blocks and len(train) < train_blocks:
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


def _too_little_text(
    dataset: AnyDataset, column: str, source: str, name: str, heldout_percentage: float, block_size: int
) -> TooLittleText:
    """Why the ``name`` split (training or held-out) of ``dataset`` fills no block, and what to do: too few documents
    for the held-out split (which takes whole documents), too few distinct ones (copies of one share its hash, so
    they fall on one side), or too little text."""
    count = len(dataset) if isinstance(dataset, datasets.Dataset) else None
    few = name == "held-out" and count is not None and count < 100.0 / heldout_percentage
    facts = (
        f"dataset '{source}' is too small: its {name} split ({heldout_percentage:g}% of documents held "
        f"out) does not fill one block of {block_size} tokens"
    )
    if few:
        facts += f"; it holds only {count} document(s) and the split takes whole documents"
        return TooLittleText(facts, _split_advice(dataset, column))
    distinct = _distinct_documents(dataset, column) if count is not None and heldout_percentage else None
    if distinct is not None and distinct < min(count, 100.0 / heldout_percentage):  # copies, and few
        facts += (
            f"; it holds only {distinct} distinct document(s) among its {count}, and the split takes whole "
            "documents by a hash of their text, so every copy of one falls on the same side"
        )
        return TooLittleText(facts, ": more copies never fill it; use more distinct text")
    return TooLittleText(facts, "; use more text or a smaller --block_size")


def _distinct_documents(dataset: datasets.Dataset, column: str) -> int:
    """How many different texts the documents of ``dataset`` hold: copies of one document share its hash, so they
    are all held out or all trained on, and a corpus of few distinct ones cannot fill both splits however long."""
    return len(dataset.unique(column))


def _split_advice(dataset: AnyDataset, column: str) -> str:
    """How to split a dataset of too few documents into more: --sample_by cuts local text files only (the
    ``text`` builder's; app/data_checks.py refuses it for any other dataset), and --sample_by line only where a
    document holds several lines (a one-line file, or one already cut by line, has no more documents to give)."""
    if getattr(getattr(dataset, "info", None), "builder_name", None) != "text":
        return ": split the text into more documents (rows)"
    texts = [text.strip() for text in dataset[column]]
    if any("\n\n" in text for text in texts):  # cut by document: the paragraphs datasets splits on are there
        return ": read each of its paragraphs as a document (--sample_by paragraph, the default), or split it into more"
    if any("\n" in text for text in texts):
        return ": split the text into more (blank lines between paragraphs, or --sample_by line)"
    return ": split the text into more lines or paragraphs (each of its documents is one line already)"


def _heldout_set(texts, tokenizer, block_size: int, count: int, seed: int, prefix_ids, description: str):
    """``count`` held-out blocks drawn from the held-out documents ``texts`` (sample_blocks); None where they do not
    fill one block (prepare_data says so, naming the split)."""
    try:
        return sample_blocks(
            texts,
            tokenizer,
            block_size=block_size,
            count=count,
            seed=seed,
            prefix_ids=prefix_ids,
            name="held-out",
            description=description,
        )
    except TooLittleText:  # only this: a row refused while reading (row_text) says what is wrong with it
        return None


def blocks_tensor(dataset: datasets.Dataset) -> torch.Tensor:
    """All blocks of a packed dataset as one ``[n, block_size]`` tensor of token ids."""
    return torch.as_tensor(dataset.with_format("torch")[:]["input_ids"])
