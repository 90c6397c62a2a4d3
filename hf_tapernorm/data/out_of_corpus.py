"""The out-of-corpus evaluation set of a command: its data arguments' reference text, sampled into blocks.

Why a second text, and why the Python documentation by default: data/heldout.py.
"""

from __future__ import annotations

import filecmp
import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

from .corpus import empty_cells_read_as_none, load_documents, row_text, text_column_of
from .heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION, EvaluationSet, python_docs_documents, sample_blocks
from .sources import EMBEDDED_CORPUS, DataError, load_text_dataset, text_digest

logger = logging.getLogger(__name__)


def out_of_corpus_set(data, tokenizer, sink_ids: Sequence[int]) -> Optional[EvaluationSet]:
    """``data.out_of_corpus_blocks`` blocks of ``data.out_of_corpus_dataset`` (None when the count is 0), a dataset's
    text read from its ``data.out_of_corpus_text_column`` (None: as --text_column's default chooses).

    The draw uses ``data.heldout_seed``, so every run of a comparison reads the same blocks. A dataset whose every
    document is one of the corpus's is refused, and one holding some of them named in a WARNING
    (check_documents_outside_corpus).
    """
    if not data.out_of_corpus_blocks:
        return None
    name = data.out_of_corpus_dataset
    if name == PYTHON_DOCS:
        documents, description = python_docs_documents(), PYTHON_DOCS_DESCRIPTION
    else:
        dataset = load_text_dataset(name, sample_by=data.sample_by, cache_dir=data.data_cache_dir, split_option=None)
        option = "--out_of_corpus_text_column"
        column = text_column_of(dataset, data.out_of_corpus_text_column, option=option)
        empty = empty_cells_read_as_none(dataset)
        texts = (row_text(row, i, column, option, empty_cell=empty) for i, row in enumerate(dataset))
        check_documents_outside_corpus(data, texts)
        documents = (
            (f"document {i}", row_text(row, i, column, option, empty_cell=empty)) for i, row in enumerate(dataset)
        )
        description = f"every document of {name}"
    return sample_blocks(
        documents,
        tokenizer,
        block_size=data.block_size,
        count=data.out_of_corpus_blocks,
        seed=data.heldout_seed,
        prefix_ids=sink_ids,
        name="out-of-corpus",
        description=description,
    )


def document_key(text: str) -> int:
    """The hash by which two documents are the same text: line ends and surrounding white space aside, as the text
    loader reads a file (universal newlines: CRLF is LF) and as a JSON row or a file's last paragraph may keep them."""
    return text_digest(text.replace("\r\n", "\n").replace("\r", "\n").strip())


def check_documents_outside_corpus(data, texts: Iterable[str]) -> None:
    """Refuse (one line) out-of-corpus ``texts`` (the documents of ``data.out_of_corpus_dataset``) of which every one
    is a document of the corpus ``data`` names, and name in a WARNING how many are where some are: their loss is the
    corpus's own, printed and recorded as the loss of text the model was not trained on. The files' bytes
    (app/data_checks.py, before the model loads) tell a copy of a file only; the same documents in another form (JSON
    Lines of the texts, another line end, a trailing newline, part of them) are found here by their text
    (document_key). Documents with no text are not counted. A streamed corpus is not read whole for this (it may be
    far larger than what a command reads of it)."""
    ours = Counter(document_key(text) for text in texts if text.strip())
    if not ours or data.streaming:
        return
    corpus = load_documents(data)
    column = text_column_of(corpus, data.text_column)
    found: set[int] = set()
    for batch in corpus.select_columns([column]).iter(batch_size=1024):
        found.update(key for text in batch[column] if isinstance(text, str) and (key := document_key(text)) in ours)
        if len(found) == len(ours):
            break
    shared, total = sum(ours[key] for key in found), sum(ours.values())
    name, source = data.out_of_corpus_dataset, data.dataset_name or EMBEDDED_CORPUS
    if shared == total:
        raise DataError(
            f"--out_of_corpus_dataset '{name}': every one of its {total} documents is a document of the training "
            f"corpus (--dataset_name '{source}'), so its loss would be the corpus's own; name text the model was not "
            "trained on, or leave it out"
        )
    if shared:
        logger.warning(
            "--out_of_corpus_dataset '%s': %d of its %d documents are documents of the training corpus (--dataset_name "
            "'%s'), so the out-of-corpus loss is partly the corpus's own; name text the model was not trained on",
            name,
            shared,
            total,
            source,
        )


def _identity(path: Path) -> tuple[int, int]:
    """The file ``path`` is (its device and inode, links followed): the same for a hard link, a symbolic link, and
    any spelling of its path."""
    info = os.stat(path)
    return info.st_dev, info.st_ino


def corpus_files_among(files: Sequence[Path], corpus: Sequence[Path]) -> tuple[dict[Path, Path], dict[Path, Path]]:
    """Which of ``files`` (an out-of-corpus dataset's) are files of ``corpus`` (the training corpus's): the same
    file however its path is spelled or linked (hard links too), or a byte-identical copy of one, which holds the
    same text. Only files of the same size are read, and only until their first difference, so the check is cheap;
    an empty file holds no text and is no copy. Returns (the same files, the copies), each file -> the corpus's."""
    ours = {_identity(path): path for path in corpus}
    by_size: dict[int, list[Path]] = {}
    for path in ours.values():
        by_size.setdefault(path.stat().st_size, []).append(path)
    same, copies = {}, {}
    for path in files:
        if _identity(path) in ours:
            same[path] = ours[_identity(path)]
            continue
        size = path.stat().st_size
        original = next((o for o in by_size.get(size, []) if size and filecmp.cmp(path, o, shallow=False)), None)
        if original is not None:
            copies[path] = original
    return same, copies


__all__ = [
    "check_documents_outside_corpus",
    "corpus_files_among",
    "document_key",
    "out_of_corpus_set",
]
