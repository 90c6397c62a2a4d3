#!/usr/bin/env python
"""The control that prices the recipe's loss terms alone: the default recipe with the gate held at 1.

A tapered run differs from its normalized baseline in two ways: the norms taper away, and the loss has
the recipe's extra terms (the distillation KL to the model at the start of the taper, the scale loss).
This run keeps the second and drops the first. It patches the model, trains it with ``TaperCallback``
exactly as ``hf-tapernorm taper`` does (the same data, learning-rate schedule, calibration and teacher
snapshot), but a callback after ``TaperCallback`` sets every gate back to 1 before each step's forwards, so
the model computes its norms throughout. Its gap to the baseline is what the terms cost by themselves; a
tapered run's gap above that is what the taper costs.

It takes the ``hf-tapernorm taper`` options, with ``--baseline_from`` naming the normalized run to compare
with (an earlier ``--baseline`` run of the same data and seed), and writes ``report.json`` in
``--output_dir``: the held-out and out-of-corpus scores of the original, the baseline and the control (the
same evaluation as the CLI's report), under the keys the fidelity harness reads::

    python -m conversion_scripts.experiments.kl_control --output_dir runs/fidelity/steps150/kl_control/seed42 \\
        --max_steps 150 --seed 42 --per_device_train_batch_size 2 --block_size 128 \\
        --baseline_from runs/fidelity/steps150/default/seed42

Training keeps its checkpoints only until the scores are written (a control is scored once, not resumed).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from transformers import HfArgumentParser, TrainerCallback

from conversion_scripts.experiments.fidelity_matrix import remove_checkpoints
from hf_tapernorm import ConfigurationError, TaperCallback, patch_model
from hf_tapernorm.app.taper import TaperRequest, prepare_run_data, recipe_config, resolve_baseline
from hf_tapernorm.app.training_run import train
from hf_tapernorm.cli.arguments import (
    DataArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.data import out_of_corpus_set
from hf_tapernorm.evaluation import broken_blocks, evaluate_set, load_model, load_tokenizer, resolve_model
from hf_tapernorm.layers import gate_of, set_gate

logger = logging.getLogger("kl_control")

#: The model under test, named as the harness's table reads a run's report (see fidelity_matrix.scores_of).
CONTROL = "control"


class HoldGateAtOne(TrainerCallback):
    """After ``TaperCallback`` has run a step's schedule (calibration, the teacher's snapshot), gate 1 again."""

    def __init__(self) -> None:
        self.scheduled_gates: list[float] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.scheduled_gates.append(gate_of(model))
        set_gate(model, 1.0)


def run_control(request: TaperRequest) -> dict[str, Any]:
    """Train the control, score it with the original and the baseline; returns what ``report.json`` holds."""
    output = Path(request.training.output_dir)
    if request.run.baseline_from is None:
        raise ConfigurationError("the control compares with a normalized run: pass --baseline_from <run folder>")
    baseline = resolve_baseline(request.run.baseline_from)
    if (output / "report.json").is_file() and not request.run.overwrite:
        raise ConfigurationError(f"{output} already holds a report: pass --overwrite to train the control again")

    source = resolve_model(request.model.model_name_or_path, request.model.gguf_file)
    tokenizer = load_tokenizer(source)
    model = load_model(source, dtype=request.model.dtype)
    config = recipe_config(request, model, tokenizer)
    packed = prepare_run_data(request, tokenizer, config.sink_token_ids)
    outside = out_of_corpus_set(request.data, tokenizer, config.sink_token_ids)

    # TaperCallback checks the schedule against max_steps and decays a WSD learning rate after the taper
    # when the Trainer is built, as in taper (the baseline's schedule).
    patch_model(model, config)
    hold, history = HoldGateAtOne(), []
    callbacks = [TaperCallback(), hold]
    trainer, interrupted = train(
        model, request.training, packed.train, output, callbacks, resume=False, history=history
    )
    if interrupted:
        raise SystemExit(f"interrupted at step {trainer.state.global_step}: nothing written")
    if gate_of(model) != 1.0 or min(hold.scheduled_gates) != 0.0:
        raise RuntimeError("the control must train at gate 1 while the schedule reaches 0")

    dtype = request.model.dtype
    models = {
        "original": load_model(source, dtype=dtype),
        "baseline": load_model(baseline, dtype=dtype),
        CONTROL: model,
    }
    batch = request.data.eval_batch_size
    report: dict[str, Any] = {
        "status": "finished",
        "what": "the default recipe with the gate held at 1: the loss terms without the taper",
        "baseline_model": str(baseline.path),
        "training": {"steps": trainer.state.global_step, "max_steps": request.training.max_steps, "final_gate": 1.0},
        "taper": {"distill_weight": config.distillation.weight, "scale_loss_weight": config.scale_loss_weight},
        "scheduled_gates": hold.scheduled_gates,  # what the taper would have set; the model trained at 1
        "history": history,  # per step: the loss with its terms (distill, scale_loss) and the cross-entropy (ce)
    }
    for key, evaluation in (("heldout", packed.heldout_set), ("out_of_corpus", outside)):
        if evaluation is None:
            continue
        scores = evaluate_set(models, evaluation, reference=models["original"], batch_size=batch)
        report[key] = {name: s.summary() for name, s in scores.items()}
        blocks_key = "heldout_documents" if key == "heldout" else "out_of_corpus_blocks"
        report[blocks_key] = {
            "against": "baseline",
            "broken_blocks": broken_blocks(scores[CONTROL], scores["baseline"]),
        }
    remove_checkpoints(output)
    (output / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    options = [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments]
    parser = HfArgumentParser(options, prog="kl_control")
    request = TaperRequest(*parser.parse_args_into_dataclasses(args=list(sys.argv[1:] if argv is None else argv)))
    report = run_control(request)
    held = report["heldout"]
    logger.info(
        "held out: baseline %.4f, control %.4f (%+.2f%%)",
        held["baseline"]["loss"],
        held[CONTROL]["loss"],
        100 * (held[CONTROL]["loss"] / held["baseline"]["loss"] - 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
