"""Evaluation sets: held-out blocks sampled across whole documents, and a reference text of another kind.

**Held-out blocks.** A short continued-pretraining run measured on the first blocks of each held-out
document reads mostly file headers (licence text, module docstrings, imports), which a fine-tuned model
learns first; one evaluation then moves by about a point between neighbouring steps. Here the held-out
documents are tokenized into one stream (each followed by EOS), the stream is cut into non-overlapping
windows, and ``count`` windows are drawn with a fixed seed, round-robin over the documents (each document's
windows in a random order): every part of every document can be drawn, no long file dominates the measure,
and every run, whatever its training seed, reads the same blocks.

**Out-of-corpus text.** A user converting a model wants it to stay good on what it was good at, not only on
the tapering corpus. The default reference is the English prose of the Python documentation that every
Python installation ships as ``pydoc_data.topics`` (the language reference's topics, as ``help()`` shows
them): real English, offline everywhere, and of another kind than source code. The embedded corpus leaves
``pydoc_data`` out, so the reference is never trained on.

Each block keeps the index of the document every target token comes from, so a report can show which
documents a gap comes from (:func:`hf_tapernorm.evaluation.scores.per_document`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigurationError
from .local_folders import TooLittleText

logger = logging.getLogger(__name__)

PYTHON_DOCS = "python-docs"
"""Name of the default out-of-corpus text: the English topics of the Python documentation (``pydoc_data``)."""

PYTHON_DOCS_DESCRIPTION = (
    "English prose of the Python language reference (pydoc_data.topics, shipped with every Python): "
    "real English text of another kind than source code, never part of the embedded corpus"
)

#: At most this many windows of the held-out stream are tokenized per sampled block: a large corpus's
#: held-out split (5% of many gigabytes) need not be read whole to draw a few hundred blocks from it.
STREAM_WINDOWS_PER_BLOCK = 16


@dataclass
class EvaluationSet:
    """``[n, block_size]`` token ids, each block ``prefix`` + text, with the document of every target token.

    ``target_documents[i, j]`` indexes ``documents`` for the target ``blocks[i, prefix_length + 1 + j]``.
    ``stream`` is the tokenized text the blocks were cut from (the documents in order, each followed by EOS)
    and ``stream_documents`` the document of each of its tokens: the robustness scan (evaluation/scan.py) draws
    windows of other lengths, at any token offset, from it.
    """

    name: str
    description: str
    blocks: torch.Tensor
    target_documents: torch.Tensor
    documents: list[str]
    prefix_length: int
    stream: Optional[torch.Tensor] = None
    stream_documents: Optional[torch.Tensor] = None

    @property
    def tokens(self) -> int:
        """Predicted tokens (the targets every model is scored on)."""
        return int(self.target_documents.numel())


def sample_blocks(
    documents: Iterable[tuple[str, str]],
    tokenizer,
    *,
    block_size: int,
    count: int,
    seed: int = 0,
    prefix_ids: Sequence[int] = (),
    name: str = "held-out",
    description: str = "",
) -> EvaluationSet:
    """``count`` blocks from random, non-overlapping positions of the concatenated ``(name, text)`` documents.

    The draw depends only on the documents, the tokenizer, ``block_size`` and ``seed``. Raises
    ``ConfigurationError`` when the documents do not fill one block; warns when they hold fewer than
    ``count`` windows (then every window is used).
    """
    prefix = [int(i) for i in prefix_ids]
    body = block_size - len(prefix)
    if body < 2:
        raise ConfigurationError(f"block_size {block_size} leaves no room for text after {len(prefix)} sink token(s)")
    if count < 1:
        raise ConfigurationError(f"the {name} set needs at least one block, got {count}")
    limit = STREAM_WINDOWS_PER_BLOCK * count * body
    ids: list[int] = []
    owners: list[int] = []
    names: list[str] = []
    eos = tokenizer.eos_token_id
    for doc_name, text in documents:
        if not text:
            continue
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            encoded = [*encoded, eos]
        ids.extend(encoded)
        owners.extend([len(names)] * len(encoded))
        names.append(doc_name)
        if len(ids) >= limit:
            break
    windows = len(ids) // body
    if windows == 0:
        raise TooLittleText(
            f"the {name} text ({len(ids)} tokens) does not fill one block of {block_size} tokens",
            "; use more text or a smaller block size",
        )
    if windows < count:
        logger.warning(
            "the %s text holds %d blocks of %d tokens (asked for %d): using them all", name, windows, block_size, count
        )
    stream, stream_owners = torch.tensor(ids), torch.tensor(owners)
    chosen = _balanced_draw(stream_owners[torch.arange(windows) * body], count, seed)
    starts = chosen * body
    offsets = torch.arange(body)
    text = stream[starts[:, None] + offsets]
    blocks = torch.cat([torch.tensor(prefix, dtype=text.dtype).expand(len(chosen), -1), text], dim=1)
    target_documents = stream_owners[starts[:, None] + offsets[1:]]
    return EvaluationSet(name, description, blocks, target_documents, names, len(prefix), stream, stream_owners)


def _balanced_draw(window_documents: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """``count`` window indices, round-robin over the documents: each document's windows in a random order, the
    documents in a random order, one window of each in turn; returned sorted.

    A plain uniform draw over windows weights documents by their length, and one long, repetitive file (a
    codec table) then dominates the measure; round-robin gives every document the same number of blocks, as
    far as its length allows, while the positions inside each document stay random.
    """
    order = torch.randperm(len(window_documents), generator=torch.Generator().manual_seed(seed)).tolist()
    taken: dict[int, int] = {}
    rank = []
    for window in order:
        document = int(window_documents[window])
        rank.append((taken.get(document, 0), len(rank), window))
        taken[document] = taken.get(document, 0) + 1
    return torch.tensor(sorted(window for _, _, window in sorted(rank)[:count]), dtype=torch.long)


def python_docs_documents() -> list[tuple[str, str]]:
    """The default out-of-corpus text: ``(topic, text)`` for every topic of ``pydoc_data.topics``, sorted."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ConfigurationError(
            "this Python has no pydoc_data module (the documentation topics); pass --out_of_corpus_dataset "
            "with a text of your own, or --out_of_corpus_blocks 0"
        ) from None
    return [(f"pydoc_data.topics:{key}", topics[key]) for key in sorted(topics)]


__all__ = [
    "EvaluationSet",
    "PYTHON_DOCS",
    "PYTHON_DOCS_DESCRIPTION",
    "STREAM_WINDOWS_PER_BLOCK",
    "python_docs_documents",
    "sample_blocks",
]
