#!/usr/bin/env python
"""An experimental arm: ``hf-tapernorm taper`` with one more loss term that keeps the sink absorbing attention.

Where a tapered model breaks on a block (docs/fidelity.md, "What breaks in a broken block"), its heads
stop sending their attention to the sink token: at layer 20 the sink's share falls from about 0.7 to 0.2,
every head mixes content into every position and the residual runs away. The distillation term sees only
the output distribution, so nothing in the recipe asks the model to keep that mechanism. This term does:
for every layer, head and query position after the sink, the share of attention on the sink (position 0)
is a Bernoulli probability, and the term is ``weight * KL(teacher share || student share)`` averaged over
layers and heads, per position, added to the training loss like the distillation KL. The teacher is the
distillation teacher (the model at the start of the taper); the term is 0 until it exists.

Both models run eager attention with ``output_attentions`` during training (the teacher is a copy of the
student, so it returns its attentions too, and a forward hook keeps them: no extra teacher forward). The
script runs the CLI's ``taper`` command with a ``TaperExtension`` (the callback below, the term's log key),
so the run folder, the report and ``--resume`` are the CLI's; the normalized baseline trains without the
term::

    python -m conversion_scripts.experiments.sink_attention --output_dir runs/fidelity/steps300/sink_attention/seed42 \\
        --max_steps 300 --seed 42 --per_device_train_batch_size 2 --block_size 128 \\
        --baseline_from runs/fidelity/steps300/default/seed42 --sink_attention_weight 1

``--sink_attention_weight`` (default 1) is this script's own option; every other option is the CLI's.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from hf_tapernorm import TaperCallback
from hf_tapernorm.cli.main import main as cli_main
from hf_tapernorm.layers import ForwardInputs, add_training_loss_term
from hf_tapernorm.pipeline.taper import TaperExtension
from hf_tapernorm.training import add_to_training_log

logger = logging.getLogger("sink_attention")

TERM = "sink_attention"
SINK = 0  # the sink's position: the run's prefix (the BOS token) comes first in every block


def sink_shares(attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    """The attention each query after the sink gives the sink: (layers, batch, heads, positions - 1), fp32."""
    return torch.stack([layer[:, :, SINK + 1 :, SINK].float() for layer in attentions])


def bernoulli_kl(teacher: torch.Tensor, student: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL(Bernoulli(teacher) || Bernoulli(student)), elementwise."""
    p = teacher.clamp(eps, 1 - eps)
    q = student.clamp(eps, 1 - eps)
    return p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())


class SinkAttentionTerm:
    """The loss term (``layers/loss_terms.Term``): summed over query positions, counted per position."""

    def __init__(self, callback: TaperCallback, weight: float) -> None:
        self.callback, self.weight = callback, weight
        self._hooked: Optional[nn.Module] = None
        self._teacher_attentions: Optional[tuple[torch.Tensor, ...]] = None
        self._window = [0.0, 0]

    def _teacher(self) -> Optional[nn.Module]:
        controller = getattr(self.callback, "controller", None)
        distillation = getattr(controller, "distillation", None)
        if distillation is None or not distillation.has_snapshot:
            return None
        teacher = distillation.teacher
        if teacher is not self._hooked:  # the snapshot is taken once the gate moves: hook it when it appears
            teacher.register_forward_hook(self._keep_attentions)
            self._hooked = teacher
        return teacher

    def _keep_attentions(self, module: nn.Module, args: Any, output: Any) -> None:
        self._teacher_attentions = output.attentions

    def __call__(self, model: nn.Module, inputs: ForwardInputs, output: Any):
        teacher = self._teacher()
        if teacher is None or output.attentions is None:
            return None
        if self._teacher_attentions is None:  # the distillation term runs first and calls the teacher
            with torch.no_grad():
                teacher(input_ids=inputs.get("input_ids"), attention_mask=inputs.get("attention_mask"))
        target, self._teacher_attentions = self._teacher_attentions, None
        kl = bernoulli_kl(sink_shares(target), sink_shares(output.attentions)).mean(dim=(0, 2))  # (batch, positions)
        mask = inputs.get("attention_mask")
        mask = mask[:, SINK + 1 :].to(kl.dtype) if mask is not None else torch.ones_like(kl)
        summed = self.weight * (kl * mask).sum()
        self._window[0] += float(summed.detach()) / max(float(mask.sum()), 1.0)
        self._window[1] += 1
        return summed, mask.sum()

    def mean_since_last(self) -> Optional[float]:
        total, forwards = self._window
        self._window = [0.0, 0]
        return total / forwards if forwards else None


class SinkAttentionCallback(TaperCallback):
    """``TaperCallback`` that also attaches the sink-attention term (and logs it as ``taper/sink_attention``)."""

    def __init__(self, *args: Any, weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight = weight

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.set_attn_implementation("eager")  # first: a teacher copied now or restored by a resume copies it
        model.config.output_attentions = True
        result = super().on_train_begin(args, state, control, model=model, **kwargs)
        self.term = SinkAttentionTerm(self, self.weight)
        add_training_loss_term(model, TERM, self.term)
        logger.info("sink-attention term attached (weight %g, eager attention)", self.weight)
        return result

    def on_log(self, args, state, control, logs=None, **kwargs):
        result = super().on_log(args, state, control, logs=logs, **kwargs)
        mean = self.term.mean_since_last()
        if logs is not None and "loss" in logs and mean is not None:
            add_to_training_log(state, logs, {"taper/sink_attention": mean})
        return result

    def on_train_end(self, args, state, control, model=None, **kwargs):
        result = super().on_train_end(args, state, control, model=model, **kwargs)
        model.config.output_attentions = False  # the saved checkpoint and the export compute logits only
        model.set_attn_implementation("sdpa")
        return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--sink_attention_weight", type=float, default=1.0)
    known, rest = own.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if not known.sink_attention_weight >= 0:
        raise SystemExit(f"--sink_attention_weight must be >= 0, got {known.sink_attention_weight}")
    return cli_main(["taper", *rest], extension=extension(known.sink_attention_weight))


def extension(weight: float) -> TaperExtension:
    """The taper run's callback with the term, its log key in the report's history, and out of its ``ce``."""
    return TaperExtension(
        taper_callback=functools.partial(SinkAttentionCallback, weight=weight),
        log_keys={f"taper/{TERM}": TERM},
        loss_terms=(TERM,),
    )


if __name__ == "__main__":
    sys.exit(main())
