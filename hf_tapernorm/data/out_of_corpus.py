"""The out-of-corpus evaluation set of a command: its data arguments' reference text, sampled into blocks.

Why a second text, and why the Python documentation by default: data/heldout.py.
"""

from __future__ import annotations

import filecmp
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .corpus import empty_cells_read_as_none, row_text, text_column_of
from .heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION, EvaluationSet, python_docs_documents, sample_blocks
from .sources import load_text_dataset


def out_of_corpus_set(data, tokenizer, sink_ids: Sequence[int]) -> Optional[EvaluationSet]:
    """``data.out_of_corpus_blocks`` blocks of ``data.out_of_corpus_dataset`` (None when the count is 0), a dataset's
    text read from its ``data.out_of_corpus_text_column`` (None: as --text_column's default chooses).

    The draw uses ``data.heldout_seed``, so every run of a comparison reads the same blocks.
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


__all__ = ["corpus_files_among", "out_of_corpus_set"]
