"""The train mode: what the default recipe costs per optimizer step, phase by phase, on real text.

A taper run's step costs differ by phase, so each phase is its own workload, all timed on the same
batch and interleaved (every one a full optimizer step: forward, backward, AdamW step):

- ``normalized``: the unpatched model, the reference of every ratio;
- ``warmup``: patched with the recipe (``TaperNormConfig.for_model``), g = 1: every tapered norm
  gathers its calibration statistics; no teacher yet;
- ``taper``: after calibration on real training-mode steps at g = 1, the gate takes the schedule's
  values in (0, 1) in turn (both branches of every tapered norm run); a recipe that distils (gated-MLP
  models) runs its teacher, the snapshot taken when the gate first fell, once per step;
- ``tapered-distilled``: g = 0 with the teacher still on (``distill_until="end"``); only for recipes
  that distil;
- ``tapered``: g = 0 after the teacher was released (``distill_until="taper_end"``).

With a precision beyond fp32 (``--train_precisions fp32 bf16``) every workload is built again as
``<name>+bf16``: the same step under ``torch.autocast`` in bf16 over fp32 master weights (what
``taper --bf16`` trains with), interleaved with the fp32 ones so their ratio is taken under the same load.

The patched workloads are driven by ``TaperController`` (``step_begin``/``step_end`` around every
step, inside the timed region as in a real loop), so the gate, the calibration, the teacher's snapshot
and release are the library's own. Each workload is its own copy of the model with its own optimizer.
Every loss is recorded and a non-finite one is flagged in the results, since a step on NaN values is
not the price of anything; the divergence watch's verdict is recorded too, but does not stop the timing.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from ..config import TaperNormConfig
from ..data.corpus import prepare_data
from ..data.local_folders import TooLittleText
from ..data.sources import EMBEDDED_CORPUS, AnyDataset, DataError
from ..errors import TaperDivergenceError
from ..layers.patching import patch_model
from ..training.controller import TaperController
from ..training.schedule import TaperSchedule
from .arguments import TRAIN_WORKLOADS
from .workloads import Workload, compiled

#: The autocast dtype of each ``--train_precisions`` value (None: plain fp32).
PRECISIONS: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16}
TAPER_STEPS = 5  # optimizer steps strictly inside the taper window: the gate values the taper workload cycles

Batch = dict[str, torch.Tensor]


def text_batches(
    dataset: AnyDataset,
    tokenizer: Any,
    *,
    batch: int,
    seq_len: int,
    count: int,
    prefix_ids: Sequence[int],
    source: str,
    text_column: Optional[str] = None,
) -> list[Batch]:
    """``count`` batches of ``batch`` packed text blocks (``input_ids`` and ``labels``), as ``taper`` builds them.

    ``prefix_ids`` (the recipe's sink tokens) start every block, as the recipe requires of its training data.
    """
    needs = f"the train mode needs {batch * count} (--batch_sizes x (1 + --calibration_batches))"
    try:
        packed = prepare_data(
            dataset,
            tokenizer,
            block_size=seq_len,
            train_blocks=batch * count,
            heldout_blocks=0,  # no held-out split: bench measures speed, and every document trains
            text_column=text_column,
            source=source,
            prefix_ids=prefix_ids,
            train_repeats=False,  # too few blocks are refused below: the batches are never read twice
            what=f"--dataset_name '{source}'" if source != EMBEDDED_CORPUS else None,  # a row refused names the option
        )
    except TooLittleText:  # its words are taper's (a held-out split, --block_size): bench has neither
        raise DataError(
            f"dataset '{source}' does not fill one block of --seq_lens {seq_len} tokens; {needs}: use more text or "
            "a smaller --seq_lens"
        ) from None
    if len(packed.train) < batch * count:
        raise DataError(f"dataset '{source}' holds {len(packed.train)} blocks of {seq_len} tokens; {needs}")
    rows = packed.train.with_format("torch")[: batch * count]
    return [{key: rows[key][i * batch : (i + 1) * batch] for key in ("input_ids", "labels")} for i in range(count)]


class TrainStep(Workload):
    """One optimizer step on ``batch``; with a controller, the optimizer step numbers in ``steps`` in turn.

    ``losses`` and ``gates`` hold what the recorded steps saw (``start_recording`` drops the setup's).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Batch,
        learning_rate: float,
        *,
        controller: Optional[TaperController] = None,
        steps: Sequence[int] = (0,),
        compile_options: Optional[dict[str, Any]] = None,
        autocast: Optional[torch.dtype] = None,
    ) -> None:
        self.model, self.batch, self.controller, self.autocast = model, batch, controller, autocast
        self.call = compiled(model, compile_options)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
        self._steps = itertools.cycle(steps)
        self.losses: list[float] = []
        self.gates: list[Optional[float]] = []
        self.divergence: Optional[str] = None

    def step(self, step: int, batch: Batch) -> torch.Tensor:
        """Optimizer step number ``step + 1`` of the schedule on ``batch``, with the controller's calls around it."""
        # replay: the timed steps cycle over the same taper steps, going back to the first of them each round
        gate = self.controller.step_begin(step, replay=True) if self.controller is not None else None
        device = batch["input_ids"].device.type
        with torch.autocast(device, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = self.call(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.controller is not None:
            try:
                self.controller.step_end(step)
            except TaperDivergenceError as error:  # flagged in the results; the timing goes on
                self.divergence = self.divergence or str(error)
        self.losses.append(float(loss.detach()))
        self.gates.append(gate)
        return loss.detach()

    def run(self, state: Any) -> torch.Tensor:
        return self.step(next(self._steps), self.batch)

    def start_recording(self) -> None:
        self.losses.clear()
        self.gates.clear()

    @property
    def has_teacher(self) -> bool:
        """Whether a distillation teacher runs in this workload's steps."""
        distillation = self.controller.distillation if self.controller is not None else None
        return distillation is not None and distillation.teacher is not None

    def facts(self) -> dict[str, Any]:
        """What the recorded steps ran: gates, teacher, whether every loss was finite, the median loss, and the
        divergence watch's message where it would have stopped a real run (a spike does not spoil a timing)."""
        return {
            "gates": sorted({g for g in self.gates if g is not None}, reverse=True) or None,
            "teacher": self.has_teacher,
            "losses_finite": all(math.isfinite(loss) for loss in self.losses),
            "loss_median": statistics.median(self.losses) if self.losses else None,
            "divergence": self.divergence,
        }


def _patched(
    model: nn.Module,
    config: TaperNormConfig,
    batches: Sequence[Batch],
    learning_rate: float,
    compile_options: Optional[dict[str, Any]],
    *,
    setup: Sequence[int],
    steps: Sequence[int],
    autocast: Optional[torch.dtype] = None,
) -> TrainStep:
    """A patched copy under a controller, taken untimed through the optimizer steps ``setup`` (numbers + 1).

    ``batches[0]`` is the timed batch; setup steps read the others (the calibration batches) in turn.
    The schedule calibrates over one step per calibration batch and ends TAPER_STEPS + 1 steps later.
    """
    calibration = list(batches[1:])
    k_start = len(calibration)
    k_end = k_start + TAPER_STEPS + 1
    patched = patch_model(copy.deepcopy(model), config).train()
    controller = TaperController(patched, TaperSchedule(k_start, k_end), total_steps=k_end)
    workload = TrainStep(
        patched,
        batches[0],
        learning_rate,
        controller=controller,
        steps=steps,
        compile_options=compile_options,
        autocast=autocast,
    )
    for i, step in enumerate(setup):
        workload.step(step, calibration[i % len(calibration)])
    workload.start_recording()
    return workload


def train_workloads(
    model: nn.Module,
    batches: Sequence[Batch],
    config: TaperNormConfig,
    *,
    learning_rate: float,
    names: Sequence[str] = TRAIN_WORKLOADS,
    compile_options: Optional[dict[str, Any]] = None,
    precisions: Sequence[str] = ("fp32",),
) -> dict[str, TrainStep]:
    """The workloads ``names`` of the module docstring for ``model`` (left unchanged) under the recipe ``config``,
    for each of ``precisions`` (fp32 keeps the plain names; bf16 adds ``<name>+bf16``, under autocast).

    ``batches``: the timed batch, then at least one calibration batch (optimizer steps at g = 1).
    ``tapered-distilled`` is left out when the recipe does not distil: it would be ``tapered`` again.
    """
    if len(batches) < 2:
        raise ValueError("train_workloads needs the timed batch and at least one calibration batch")
    k_start = len(batches) - 1
    k_end = k_start + TAPER_STEPS + 1
    # Steps are 0-based (the controller's ``step``; the schedule counts step + 1): 0 .. k_start - 1 run at
    # g = 1 and gather statistics, k_start calibrates and snapshots the teacher (0 < g < 1), and k_end - 1
    # is the first at g = 0, where a teacher kept only until the taper's end is released.
    warm = [*range(k_start), k_start]
    phases = {  # name: (distill_until, setup steps, timed steps)
        "warmup": (config.distillation.until, [], [0]),
        "taper": (config.distillation.until, warm, range(k_start, k_end - 1)),
        "tapered-distilled": ("end", [*warm, k_end - 1], [k_end - 1]),
        "tapered": ("taper_end", [*warm, k_end - 1], [k_end - 1]),
    }
    workloads = {}
    for precision in precisions:
        autocast = PRECISIONS[precision]
        suffix = "" if autocast is None else f"+{precision}"
        for name in (n for n in TRAIN_WORKLOADS if n in names):
            if name == "normalized":
                workloads[name + suffix] = TrainStep(
                    copy.deepcopy(model).train(),
                    batches[0],
                    learning_rate,
                    compile_options=compile_options,
                    autocast=autocast,
                )
            elif name != "tapered-distilled" or config.distillation.weight > 0:
                until, setup, steps = phases[name]
                workloads[name + suffix] = _patched(
                    model,
                    config.replace(distill_until=until),
                    batches,
                    learning_rate,
                    compile_options,
                    setup=setup,
                    steps=steps,
                    autocast=autocast,
                )
    return workloads


def fp32_counterpart(name: str) -> Optional[str]:
    """The fp32 workload a ``<name>+<precision>`` workload repeats under autocast (None for an fp32 one)."""
    base, _, precision = name.rpartition("+")
    return base if base and precision in PRECISIONS else None


__all__ = [
    "PRECISIONS",
    "TAPER_STEPS",
    "TRAIN_WORKLOADS",
    "TrainStep",
    "fp32_counterpart",
    "text_batches",
    "train_workloads",
]
