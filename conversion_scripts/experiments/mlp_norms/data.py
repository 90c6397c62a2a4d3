"""Byte-level corpus of the Python standard library sources, every block starting with a BOS token.

Adapted from ``conversion_scripts/experiments/from_scratch.py``; the files are the product's
embedded-corpus listing (``embedded_corpus_files``: tests and ``pydoc_data`` left out). Every 10th sorted
``.py`` file is held out. A block is ``[BOS] + (seq - 1)`` consecutive bytes
of the training (or held-out) stream, so position 0 is always the same token, as in the SmolLM2 runs
(where every block starts with ``<|im_start|>``): that is what lets a pretrained model grow an
attention sink with a massive activation on position 0, and what lets the sink stay normalized.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hf_tapernorm.data import embedded_corpus_files

BYTES = 256
BOS = 256  # one extra symbol after the 256 byte values
VOCAB_SIZE = 257


@dataclass
class Corpus:
    train: torch.Tensor  # token stream (int64)
    valid: torch.Tensor
    files: int
    bos: int = BOS
    vocab: int = VOCAB_SIZE


_CACHE: dict = {}


def load_corpus(train_bytes: int = 24_000_000, valid_bytes: int = 400_000, root: Optional[Path] = None) -> Corpus:
    """Deterministic split by file (every 10th sorted file held out); cached per process."""
    key = (train_bytes, valid_bytes, str(root))
    if key in _CACHE:
        return _CACHE[key]
    train, valid = bytearray(), bytearray()
    used = 0
    for index, path in enumerate(embedded_corpus_files(root)):
        if len(train) >= train_bytes and len(valid) >= valid_bytes:
            break
        target, limit = (valid, valid_bytes) if index % 10 == 0 else (train, train_bytes)
        if len(target) >= limit:
            continue
        try:
            target += path.read_bytes() + b"\n"
        except OSError:
            continue
        used += 1
    train_bytes = min(train_bytes, len(train))
    if len(valid) < valid_bytes:
        raise ValueError(f"mlp_norms: only {len(valid)} held-out bytes, {valid_bytes} requested")

    def as_tokens(data: bytearray, n: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8).long()

    corpus = Corpus(as_tokens(train, train_bytes), as_tokens(valid, valid_bytes), used)
    _CACHE[key] = corpus
    return corpus


def with_bos(windows: torch.Tensor, bos: int = BOS) -> torch.Tensor:
    return torch.cat([torch.full((windows.shape[0], 1), bos, dtype=torch.long), windows], dim=1)


def held_out_blocks(corpus: Corpus, seq: int, count: int) -> torch.Tensor:
    """``count`` consecutive non-overlapping held-out blocks of ``seq`` tokens (BOS first)."""
    body = seq - 1
    need = count * body
    if corpus.valid.numel() < need:
        raise ValueError(f"mlp_norms: {count} held-out blocks of {seq} need {need} bytes")
    return with_bos(corpus.valid[:need].view(count, body), corpus.bos)


def training_batches(corpus: Corpus, batch: int, seq: int, seed: int, start: int = 0) -> Iterator[torch.Tensor]:
    """An endless stream of [batch, seq] blocks (random windows, BOS first); order fixed by ``seed``.

    ``start`` skips that many batches (a resumed stream gives the same batches as an unbroken one).
    """
    generator = torch.Generator().manual_seed(1_000_003 * (seed + 1))
    span = corpus.train.numel() - seq
    offsets = torch.arange(seq - 1)
    index = 0
    while True:
        starts = torch.randint(0, span, (batch,), generator=generator)
        if index >= start:
            yield with_bos(corpus.train[starts[:, None] + offsets], corpus.bos)
        index += 1


def load_bpe_corpus(vocab: int = 4096, train_bytes: int = 24_000_000, valid_bytes: int = 400_000) -> Corpus:
    """The same files as ``load_corpus``, tokenized with SmolLM2's BPE tokenizer (offline, from the
    embedded GGUF) and restricted to the ``vocab - 2`` most frequent training tokens; the others map
    to UNK (``vocab - 2``) and BOS is ``vocab - 1``. Cached under $MLPNORMS_ROOT."""
    import os

    root = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))
    key = ("bpe", vocab, train_bytes, valid_bytes)
    if key in _CACHE:
        return _CACHE[key]
    cache = root / f"bpe_corpus_{vocab}_{train_bytes}.pt"
    if cache.exists():
        saved = torch.load(cache)
        corpus = Corpus(saved["train"], saved["valid"], saved["files"], bos=vocab - 1, vocab=vocab)
        _CACHE[key] = corpus
        return corpus
    from hf_tapernorm.evaluation import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    raw = load_corpus(train_bytes, valid_bytes)

    def encode(stream: torch.Tensor) -> torch.Tensor:
        text = bytes(stream.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        ids: list[int] = []
        step = 200_000
        for i in range(0, len(text), step):
            ids += tok(text[i : i + step], add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    train, valid = encode(raw.train), encode(raw.valid)
    counts = torch.bincount(train)
    top = torch.argsort(counts, descending=True)[: vocab - 2]
    mapping = torch.full((max(int(train.max()), int(valid.max())) + 1,), vocab - 2, dtype=torch.long)
    mapping[top] = torch.arange(len(top))
    corpus = Corpus(mapping[train], mapping[valid], raw.files, bos=vocab - 1, vocab=vocab)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"train": corpus.train, "valid": corpus.valid, "files": corpus.files, "top": top}, cache)
    _CACHE[key] = corpus
    return corpus


def corpus_for(tokenizer: str) -> Corpus:
    """``bytes`` (default) or ``bpe<V>`` (SmolLM2's tokenizer restricted to V symbols)."""
    if tokenizer in ("bytes", "", None):
        return load_corpus()
    if tokenizer.startswith("bpe"):
        return load_bpe_corpus(int(tokenizer[3:]))
    raise ValueError(f"unknown tokenizer {tokenizer!r}")
