"""Data sources for ``taper_run``: SmolLM2-135M on tokenized stdlib sources, and a tiny random Llama.

SmolLM2 (as in smollm2_fidelity.py, session 3 on): Python files packed into blocks that all start with
BOS (``<|im_start|>``, the sink), documents separated by EOS; every 8th sorted file is held out and
training blocks are drawn in a fixed random order (re-shuffled each epoch). ``--data-scope top`` uses
the standard library's top-level modules (the fidelity runs' data, about 2.6M tokens); ``all`` every
``.py`` file under it (tens of millions of tokens, for GPU budgets). Tokenized blocks are cached
under $MLPNORMS_ROOT (default /tmp/mlpnorms).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_tapernorm.config import sink_token_id

from .source import Source

ROOT = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))


def stdlib_files(scope: str, max_bytes: int = 100_000_000) -> list[Path]:
    """``top``: the standard library's top-level modules; ``all``: every stdlib ``.py``; ``site``: also the
    installed packages' sources (site-packages: torch, transformers, ...), up to ``max_bytes``."""
    lib = Path(os.__file__).parent
    if scope == "top":
        return sorted(lib.glob("*.py"))
    if scope == "all":
        return sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.relative_to(lib).parts)
    if scope != "site":
        raise ValueError(f"data scope must be top, all or site, got {scope!r}")
    roots = [lib] + [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    files, seen, total = [], set(), 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size > 2_000_000:  # generated tables, not source
                continue
            files.append(path)
            total += size
            if total >= max_bytes:
                return sorted(files)
    return sorted(files)


def pack(tok, paths, seq: int) -> torch.Tensor:
    """[n, seq] blocks: BOS + seq - 1 tokens of the files' text in order (EOS between files)."""
    bos, sep = sink_token_id(tok), tok.eos_token_id
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    ids: list[int] = []
    for i in range(0, len(texts), 64):
        for row in tok(texts[i : i + 64])["input_ids"]:
            ids += row + [sep]
    n = len(ids) // (seq - 1)
    body = torch.tensor(ids[: n * (seq - 1)], dtype=torch.long).view(n, seq - 1)
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), body], dim=1)


def token_blocks(tok, seq: int, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(training pool, held-out pool) of BOS-first blocks; cached on disk."""
    cache = ROOT / f"smollm2_blocks_{scope}_{seq}.pt"
    if cache.exists():
        saved = torch.load(cache)
        return saved["train"], saved["held"]
    files = stdlib_files(scope)
    held_files, train_files = files[::8], [f for i, f in enumerate(files) if i % 8]
    train, held = pack(tok, train_files, seq), pack(tok, held_files, seq)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "held": held}, cache)
    return train, held


def shuffled_batches(pool: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches from a fixed random order of the pool's blocks, a new order every epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(pool), generator=generator)
        for i in range(0, len(order) - batch + 1, batch):
            yield pool[order[i : i + batch]]


def load_smollm2(path: str | None = None):
    from hf_tapernorm.evaluation import load_model, load_tokenizer, resolve_model

    source = resolve_model(path)
    model = load_model(source)
    tok = load_tokenizer(source)
    return model.float(), tok


def smollm2_source(cfg):
    model, tok = load_smollm2(cfg.model_path or None)
    train, held = token_blocks(tok, cfg.seq, getattr(cfg, "data_scope", "top"))
    held_blocks = held[: cfg.eval_blocks]
    if len(held_blocks) < cfg.eval_blocks:
        raise RuntimeError(f"only {len(held)} held-out blocks of {cfg.seq} tokens")
    return Source(
        model=model,
        sink_ids=[sink_token_id(tok)],
        batches=shuffled_batches(train, cfg.batch, seed=cfg.seed),
        held=held_blocks,
        pretrain_tokens=None,
        params=sum(p.numel() for p in model.parameters()),
    )


def tiny_source(cfg):
    """A tiny random Llama on stdlib bytes: for smoke tests (no download, seconds)."""
    from .data import held_out_blocks, load_corpus, training_batches
    from .testbed import build_model

    corpus = load_corpus(train_bytes=400_000, valid_bytes=40_000)
    model = build_model("tiny", "swiglu", cfg.seq, seed=cfg.seed)
    held = held_out_blocks(corpus, cfg.seq, cfg.eval_blocks)
    return Source(
        model=model,
        sink_ids=[int(held[0, 0])],
        batches=training_batches(corpus, cfg.batch, cfg.seq, seed=cfg.seed),
        held=held,
        pretrain_tokens=0,
        params=sum(p.numel() for p in model.parameters()),
    )
