"""Held-out loss of any causal LM on packed blocks: per token, per block, per document, and the KL to a reference.

One computation for every model kind the CLI compares (original, normalized baseline, tapered at
g = 0, folded export), so their numbers differ only by the model. Every model is scored on the same
targets: with a sink prefix of ``n`` tokens, the text tokens after the first (the first text token's
prediction is made at the sink position, which a folded model never computes). Every model reads the same
blocks: a folded model that holds the sink itself (``config.sink_token_ids``) takes their leading sink for
its stored one, and a patched model with a sink refuses blocks that do not start with it.

Evaluation runs in eval mode, without gradients and with autocast off, in each model's own dtype: a
model left under a mixed-precision context by its training must not score differently here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.heldout import EvaluationSet
from ..layers.sink import check_sink_first

#: How many documents the per-document table of a report shows (those that lose most).
DOCUMENTS_SHOWN = 10


@dataclass
class Scores:
    """Per-target-token cross-entropy (``[n, targets]``) and, with a reference, KL(reference || model) per token."""

    cross_entropy: torch.Tensor
    kl: Optional[torch.Tensor] = None

    def summary(self) -> dict[str, float]:
        """``{"loss", "perplexity", "tokens"}`` (and ``"kl"`` with a reference): token-weighted means."""
        mean = float(self.cross_entropy.double().mean())
        result = {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": int(self.cross_entropy.numel())}
        if self.kl is not None:
            result["kl"] = float(self.kl.double().mean())
        return result

    def per_block(self) -> list[float]:
        return self.cross_entropy.double().mean(dim=1).tolist()


def _held_sink(model: nn.Module) -> list[int]:
    return list(getattr(getattr(model, "config", None), "sink_token_ids", None) or [])


def _check_sink(model: nn.Module, blocks: torch.Tensor, prefix_length: int, where: str) -> None:
    trained_sink = getattr(getattr(model, "tapernorm_config", None), "sink_token_ids", None)
    if trained_sink:  # a patched model with a sink: every block must start with it
        check_sink_first(blocks, trained_sink, where)
    held_sink = _held_sink(model)
    if held_sink and (prefix_length != len(held_sink) or blocks[:, :prefix_length].ne(torch.tensor(held_sink)).any()):
        raise ValueError(
            f"{type(model).__name__} holds the sink token(s) {held_sink} as a cache prefix, so the held-out blocks "
            f"must start with exactly them (got prefix_length={prefix_length}, first block starts "
            f"{blocks[0, : len(held_sink)].tolist()})"
        )


def _target_log_probs(model: nn.Module, ids: torch.Tensor, prefix_length: int) -> torch.Tensor:
    """Log-probabilities (fp32) predicting ``ids[:, prefix_length + 1:]``: ``[batch, targets, vocab]``."""
    logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[:, prefix_length:-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@torch.no_grad()
def score_models(
    models: Mapping[str, nn.Module],
    blocks: torch.Tensor,
    *,
    prefix_length: int = 0,
    reference: Optional[nn.Module] = None,
    batch_size: int = 4,
    desc: str = "evaluating",
    where: str = "score_models",
) -> dict[str, Scores]:
    """Score every model on the same blocks in one pass (the reference's distribution computed once per batch).

    ``blocks``: ``[n, block_size]`` token ids starting with ``prefix_length`` sink tokens. With a
    ``reference`` (the original model), each model's ``Scores.kl`` is KL(reference || model) per token.
    Models are put in eval mode and left there.
    """
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"expected a non-empty [n, block_size] tensor of token ids, got shape {tuple(blocks.shape)}")
    for model in [*models.values(), *([reference] if reference is not None else [])]:
        _check_sink(model, blocks, prefix_length, where)
        model.eval()
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for start in tqdm(range(0, blocks.shape[0], batch_size), desc=desc, unit="batch", leave=False):
        ids = blocks[start : start + batch_size]
        targets = ids[:, prefix_length + 1 :]
        with _autocast_off(ids):
            reference_log_probs = _target_log_probs(reference, ids, prefix_length) if reference is not None else None
            reference_probs = reference_log_probs.exp() if reference_log_probs is not None else None
            for name, model in models.items():
                if model is reference:  # the original scored as one of the models: one forward, KL 0
                    log_probs = reference_log_probs
                else:
                    log_probs = _target_log_probs(model, ids, prefix_length)
                losses[name].append(-log_probs.gather(-1, targets[..., None]).squeeze(-1))
                if reference_probs is not None:
                    kls[name].append((reference_probs * (reference_log_probs - log_probs)).sum(-1))
    return {
        name: Scores(torch.cat(losses[name]), torch.cat(kls[name]) if reference is not None else None)
        for name in models
    }


def _autocast_off(ids: torch.Tensor):
    device_types = {"cpu", "cuda", "xpu", "mps"}
    kind = ids.device.type if ids.device.type in device_types else "cpu"
    try:
        return torch.autocast(device_type=kind, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


def evaluate_set(
    models: Mapping[str, nn.Module],
    evaluation: EvaluationSet,
    *,
    reference: Optional[nn.Module] = None,
    batch_size: int = 4,
) -> dict[str, Scores]:
    """:func:`score_models` on an :class:`EvaluationSet` (its blocks and sink prefix)."""
    return score_models(
        models,
        evaluation.blocks,
        prefix_length=evaluation.prefix_length,
        reference=reference,
        batch_size=batch_size,
        desc=f"{evaluation.name} ({', '.join(models)})",
    )


def per_document(
    model: Scores, reference: Scores, evaluation: EvaluationSet, *, top: int = DOCUMENTS_SHOWN
) -> list[dict[str, float | str | int]]:
    """The documents where ``model`` loses most against ``reference`` (by summed excess loss), ``top`` of them.

    Each row: document, tokens, both mean losses, the relative gap, and the document's share of the
    whole set's excess loss (shares of all documents sum to 1 where the total excess is not zero).
    """
    owners = evaluation.target_documents.reshape(-1)
    excess = (model.cross_entropy - reference.cross_entropy).double().reshape(-1)
    count = len(evaluation.documents)
    tokens = torch.bincount(owners, minlength=count)
    model_sum = torch.bincount(owners, weights=model.cross_entropy.double().reshape(-1), minlength=count)
    reference_sum = torch.bincount(owners, weights=reference.cross_entropy.double().reshape(-1), minlength=count)
    excess_sum = torch.bincount(owners, weights=excess, minlength=count)
    total = float(excess_sum.sum())
    rows = []
    for index in torch.argsort(excess_sum, descending=True).tolist():
        if tokens[index] == 0:
            continue
        model_loss = float(model_sum[index] / tokens[index])
        reference_loss = float(reference_sum[index] / tokens[index])
        rows.append(
            {
                "document": evaluation.documents[index],
                "tokens": int(tokens[index]),
                "reference_loss": reference_loss,
                "loss": model_loss,
                "gap": model_loss / reference_loss - 1.0 if reference_loss else float("nan"),
                "share_of_excess": float(excess_sum[index]) / total if total else float("nan"),
            }
        )
        if len(rows) == top:
            break
    return rows


#: A block the tapered model loses by more than this many nats per token (mean over the block) against the
#: reference is "broken": past some token the model's predictions are worse than chance. Such blocks are rare
#: and dominate a mean; the report counts them and gives the gap without them, so the two can be told apart.
BROKEN_BLOCK_NATS = 2.0


def broken_blocks(model: Scores, reference: Scores, *, threshold: float = BROKEN_BLOCK_NATS) -> dict[str, object]:
    """The blocks where ``model`` loses more than ``threshold`` nats per token against ``reference``, and the gap
    of the mean loss over the other blocks (``gap_without``; None when every block is broken)."""
    excess = model.cross_entropy.double().mean(1) - reference.cross_entropy.double().mean(1)
    broken = excess > threshold
    kept = ~broken
    gap = None
    if kept.any():
        gap = float(model.cross_entropy[kept].double().mean() / reference.cross_entropy[kept].double().mean() - 1)
    return {"threshold_nats": threshold, "blocks": torch.nonzero(broken).flatten().tolist(), "gap_without": gap}


def heldout_loss(
    model: nn.Module,
    blocks: torch.Tensor,
    *,
    batch_size: int = 4,
    desc: str = "evaluating",
    prefix_length: int = 0,
) -> dict[str, float]:
    """Token-weighted mean next-token cross-entropy of one model over ``blocks``: ``{"loss", "perplexity", "tokens"}``.

    ``tokens`` counts predicted tokens (``block_size - prefix_length - 1`` per block; see the module docstring).
    """
    scores = score_models(
        {"model": model}, blocks, prefix_length=prefix_length, batch_size=batch_size, desc=desc, where="heldout_loss"
    )
    return scores["model"].summary()


__all__ = [
    "BROKEN_BLOCK_NATS",
    "DOCUMENTS_SHOWN",
    "Scores",
    "broken_blocks",
    "evaluate_set",
    "heldout_loss",
    "per_document",
    "score_models",
]
