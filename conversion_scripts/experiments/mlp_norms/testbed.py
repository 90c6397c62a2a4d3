"""Small pre-norm Llama testbeds (SwiGLU and a GELU twin), pretrained normally on stdlib bytes.

The SwiGLU model is a plain ``LlamaForCausalLM`` (RMSNorm, RoPE, gated SiLU MLP). The GELU twin is
the same model with every ``mlp`` replaced by a non-gated ``down(gelu(up(x)))`` of width 4d, which
has the same parameter count as the SwiGLU MLP of width 8d/3 (both 8 d^2): the only difference is
the MLP's degree in its input's scale (2 against 1).

    python -m conversion_scripts.experiments.mlp_norms.testbed pretrain --size s --mlp swiglu --steps 3000

Checkpoints go to /tmp/mlpnorms/ckpt/<name>.pt (never into the repository).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .data import BOS, VOCAB_SIZE, corpus_for, held_out_blocks, load_corpus, training_batches

ROOT = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))
CKPT = ROOT / "ckpt"

# name: (hidden, layers, heads)
SIZES = {
    "xs": (64, 8, 4),
    "s": (96, 12, 4),
    "m": (128, 16, 4),
    "l": (192, 16, 6),
    "d12": (64, 12, 4),
    "d24": (64, 24, 4),  # deep and narrow: SmolLM2 has 30 layers; depth compounds a token's excess
    "d32": (64, 32, 4),
    "d24w": (96, 24, 4),
    "tiny": (32, 2, 2),
}


class GeluMLP(nn.Module):
    """Non-gated MLP, down(gelu(up(x))): degree 1 in the scale of its input (GPT-2's MLP)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def llama_config(size: str, seq: int = 128, vocab: int = VOCAB_SIZE, bos: int = BOS) -> LlamaConfig:
    hidden, layers, heads = SIZES[size]
    intermediate = 16 * math.ceil(8 * hidden / 3 / 16)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        rms_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build_model(
    size: str, mlp: str = "swiglu", seq: int = 128, seed: int = 0, vocab: int = VOCAB_SIZE, bos: int = BOS
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = llama_config(size, seq, vocab, bos)
    model = LlamaForCausalLM(config)
    if mlp == "gelu":
        for layer in model.model.layers:
            layer.mlp = GeluMLP(config.hidden_size, 4 * config.hidden_size)
        model.apply(model._init_weights)  # the new MLPs get the config's initialisation
        torch.manual_seed(seed)
    elif mlp != "swiglu":
        raise ValueError(f"mlp must be swiglu or gelu, got {mlp!r}")
    model.config.mlp_kind = mlp
    return model


def checkpoint_path(name: str) -> Path:
    return CKPT / f"{name}.pt"


def load_testbed(name: str) -> tuple[LlamaForCausalLM, dict]:
    """The normalized pretrained model saved by ``pretrain`` and its metadata."""
    saved = torch.load(checkpoint_path(name), weights_only=False, map_location="cpu")
    meta = saved["meta"]
    model = build_model(
        meta["size"], meta["mlp"], meta["seq"], vocab=meta.get("vocab", VOCAB_SIZE), bos=meta.get("bos", BOS)
    )
    model.load_state_dict(saved["state_dict"])
    return model, meta


@torch.no_grad()
def held_out_ce(model: nn.Module, blocks: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token CE over all targets of the held-out blocks (BOS is never a target)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch):
        x = blocks[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(ce)
        count += x[:, 1:].numel()
    model.train(was)
    return total / count


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def pretrain(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    name = args.name or f"{args.mlp}_{args.size}_{args.steps}"
    corpus = corpus_for(args.tokenizer)
    held = held_out_blocks(corpus, args.seq, args.eval_blocks)
    model = build_model(args.size, args.mlp, args.seq, args.seed, vocab=corpus.vocab, bos=corpus.bos)
    args.vocab, args.bos = corpus.vocab, corpus.bos
    model.train()
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, int(0.05 * args.steps))

    def factor(k: int) -> float:  # linear warmup, cosine to 10% of the peak
        if k < warm:
            return (k + 1) / warm
        progress = (k - warm) / max(1, args.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    CKPT.mkdir(parents=True, exist_ok=True)
    log_path = ROOT / "logs" / f"pretrain_{name}.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    started = time.time()
    batches = training_batches(corpus, args.batch, args.seq, seed=args.seed)
    evals = []
    for step in range(1, args.steps + 1):
        x = next(batches)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        row = {"step": step, "ce": float(out.loss), "grad_norm": gn, "lr": sched.get_last_lr()[0]}
        if step % args.eval_every == 0 or step == args.steps:
            row["eval_ce"] = held_out_ce(model, held)
            row["sec"] = round(time.time() - started, 1)
            evals.append((step, row["eval_ce"]))
            print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            _save(model, args, name + f"_at{step}", step, evals, time.time() - started)
    meta = _save(model, args, name, args.steps, evals, time.time() - started)
    return meta


def _save(model, args, name: str, step: int, evals, seconds: float) -> dict:
    meta = {
        "name": name,
        "size": args.size,
        "mlp": args.mlp,
        "seq": args.seq,
        "tokenizer": args.tokenizer,
        "vocab": args.vocab,
        "bos": args.bos,
        "steps": step,
        "batch": args.batch,
        "tokens": step * args.batch * args.seq,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "evals": evals,
        "seconds": round(seconds, 1),
    }
    torch.save({"state_dict": model.state_dict(), "meta": meta}, checkpoint_path(name))
    return meta


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("pretrain")
    q.add_argument("--name", default=None)
    q.add_argument("--size", choices=list(SIZES), default="s")
    q.add_argument("--mlp", choices=("swiglu", "gelu"), default="swiglu")
    q.add_argument("--steps", type=int, default=3000)
    q.add_argument("--batch", type=int, default=16)
    q.add_argument("--seq", type=int, default=128)
    q.add_argument("--lr", type=float, default=3e-3)
    q.add_argument("--weight-decay", type=float, default=0.1)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--eval-every", type=int, default=250)
    q.add_argument("--eval-blocks", type=int, default=64)
    q.add_argument("--save-every", type=int, default=0)
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--tokenizer", default="bytes", help="bytes, or bpe<V>: SmolLM2's BPE restricted to V symbols")
    b = sub.add_parser("bench")
    b.add_argument("--sizes", nargs="+", default=["xs", "s", "m"])
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    if args.command == "pretrain":
        print(json.dumps(pretrain(args)))
    else:
        torch.set_num_threads(1)
        corpus = load_corpus()
        for size in args.sizes:
            for mlp in ("swiglu", "gelu"):
                model = build_model(size, mlp, args.seq)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                batches = training_batches(corpus, args.batch, args.seq, 0)
                times = []
                for _ in range(6):
                    t = time.time()
                    x = next(batches)
                    model(input_ids=x, labels=x).loss.backward()
                    opt.step()
                    opt.zero_grad()
                    times.append(time.time() - t)
                n = sum(p.numel() for p in model.parameters())
                print(
                    f"{size} {mlp} params {n:,} step {min(times[2:]):.3f}s median {sorted(times[2:])[2]:.3f}s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
