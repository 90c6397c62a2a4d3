"""The typed record of one ``taper`` run: what the report, the model card and ``--resume`` read.

The pipeline fills it as the run goes; ``to_dict`` is report.json. Its ``identity`` (model, data and
every option that shapes the schedule) is stored in the run folder's manifest and in every
checkpoint, so ``--resume`` can refuse a run that is not the one it continues.

Paths in it are found again from any working folder (recorded_path): the run's baseline is recorded absolute,
the model and data as the user named them (the model card shows those names) with the taper command's working
folder beside them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import TaperNormConfig
from ..data.sources import local_dataset_path
from ..utils import expand_user, parameter_count

logger = logging.getLogger(__name__)


@dataclass
class ModelFacts:
    source: str
    name: str
    kind: str  # embedded | gguf | folder | hub
    model_type: str
    parameters: int
    dtype: str


@dataclass
class DataFacts:
    source: str
    text_column: str
    block_size: int
    train_blocks: int
    heldout_blocks: int
    heldout_tokens: int
    heldout_percentage: float
    #: The draw of the held-out blocks and of the scan's windows (--heldout_seed), which fold's scan draws again.
    heldout_seed: int
    #: How the text was read (READING_KEYS: config, split, ..., the out-of-corpus dataset), so that a later reader
    #: (fold's robustness scan) reads the same text the same way.
    reading: dict[str, Any] = field(default_factory=dict)
    #: An extension's facts of its training data (extension.py), over the ones above where they share a key.
    extension: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report's ``data`` section: the fields, with the extension's facts among them."""
        facts = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("reading", "extension")
        }
        return {**facts, **self.reading, **self.extension}


@dataclass
class TrainingFacts:
    max_steps: int
    global_batch_blocks: int
    learning_rate: float
    lr_scheduler_type: str
    world_size: int
    steps: Optional[int] = None
    tokens: Optional[int] = None
    seconds: Optional[float] = None
    final_gate: Optional[float] = None
    wall_seconds: Optional[float] = None
    mixed_precision: Optional[str] = None  # "bf16" or "fp16" autocast (fp32 master weights); None: the weights' dtype
    precision: Optional[str] = None  # precision_line: what the run trained in and who chose it


def precision_line(training_args: Any) -> str:
    """What the run trains in and why, for the top of its log and report: the same command trains in bf16 on a
    machine where bf16 is fast and in fp32 elsewhere, so a reader must see which, and whether it was asked."""
    kind = "bf16 autocast" if training_args.bf16 else "fp16 autocast" if training_args.fp16 else "fp32"
    chosen = getattr(training_args, "precision_chosen_by_machine", False)
    why = (
        "chosen by this machine, where bf16 is fast (--bf16 false trains in fp32)"
        if chosen and training_args.bf16
        else "chosen by this machine, where bf16 is not faster than fp32 (--bf16 true trains in bf16)"
        if chosen
        else "as asked"
    )
    return f"precision: {kind}, {why}; evaluation and export in fp32"


@dataclass
class RunRecord:
    model: ModelFacts
    data: DataFacts
    config: TaperNormConfig
    training: TrainingFacts
    taper_start_step: int
    taper_end_step: int
    status: str = "running"
    tapered_norms: Optional[int] = None
    scale_target: Optional[float] = None
    heldout: dict[str, dict[str, float]] = field(default_factory=dict)
    out_of_corpus: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> CE and KL to the original
    heldout_documents: dict[str, Any] = field(default_factory=dict)  # the documents that lose most (evaluation.py)
    out_of_corpus_blocks: dict[str, Any] = field(default_factory=dict)  # its broken blocks, as heldout_documents'
    robustness_scan: dict[str, Any] = field(default_factory=dict)  # the folded model's scan (evaluation/scan.py)
    evaluation_sets: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> description, blocks, tokens
    fold: dict[str, Any] = field(default_factory=dict)
    export: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    baseline_history: Optional[list[dict[str, Any]]] = None
    calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    ops: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> aten ops per generated token
    samples: list[dict[str, str]] = field(default_factory=list)  # greedy continuations of held-out prompts
    allowed_changes: dict[str, Any] = field(default_factory=dict)  # --resume --allow_changes: old -> new
    working_folder: str = field(default_factory=os.getcwd)  # what the relative paths above are relative to
    home_folder: str = field(default_factory=lambda: str(expand_user("~", strict=False)))  # what ~/ is in them

    # ------------------------------------------------------------------ derived
    def gap(self) -> dict[str, Optional[float]]:
        loss = {kind: values.get("loss") for kind, values in self.heldout.items()}
        outside = {kind: values.get("loss") for kind, values in self.out_of_corpus.items()}
        return {
            "tapered_vs_baseline": relative_gap(loss.get("tapered"), loss.get("baseline")),
            "tapered_vs_original": relative_gap(loss.get("tapered"), loss.get("original")),
            "folded_vs_tapered": relative_gap(loss.get("folded"), loss.get("tapered")),
            "out_of_corpus_folded_vs_baseline": relative_gap(outside.get("folded"), outside.get("baseline")),
            "out_of_corpus_folded_vs_original": relative_gap(outside.get("folded"), outside.get("original")),
        }

    def taper(self) -> dict[str, Any]:
        """The recipe as the report shows it: every TaperNormConfig option (the flags' names; ``experimental``: the
        experimental options set), plus the resolved schedule."""
        values = self.config.options()
        values.update(taper_start_step=self.taper_start_step, taper_end_step=self.taper_end_step)
        if self.tapered_norms is not None:
            values["tapered_norms"] = self.tapered_norms
        if self.scale_target is not None:
            values["scale_target"] = self.scale_target
        if self.config.distillation.weight == 0:
            values["distill_until"] = None
        return values

    def add_evaluation_sets(self, *evaluations: Any) -> None:
        """Name, description, blocks and tokens of each evaluation set (an EvaluationSet; None: absent)."""
        for evaluation in evaluations:
            if evaluation is not None:
                self.evaluation_sets[evaluation.name] = {
                    "description": evaluation.description,
                    "blocks": len(evaluation.blocks),
                    "tokens": evaluation.tokens,
                }

    def to_dict(self) -> dict[str, Any]:
        """report.json."""
        data: dict[str, Any] = {
            "status": self.status,
            "model": dataclasses.asdict(self.model),
            "data": self.data.to_dict(),
            "taper": self.taper(),
            "training": dataclasses.asdict(self.training),
            "evaluation_sets": self.evaluation_sets,
            "heldout": self.heldout,
            "out_of_corpus": self.out_of_corpus,
            "heldout_documents": self.heldout_documents,
            "out_of_corpus_blocks": self.out_of_corpus_blocks,
            "robustness_scan": self.robustness_scan,
            "gap": self.gap(),
            "fold": self.fold,
            "export": self.export,
            "history": self.history,
            "working_folder": self.working_folder,
            "home_folder": self.home_folder,
        }
        if self.baseline_history is not None:
            data["baseline_history"] = self.baseline_history
        if self.calibration:
            data["diagnostics"] = {"calibration": self.calibration}
        if self.ops:
            data["ops_per_token"] = self.ops
        if self.samples:
            data["samples"] = self.samples
        if self.allowed_changes:
            data["allowed_changes"] = self.allowed_changes
        return data

    def card_facts(self) -> dict[str, Any]:
        """The run in the model card's vocabulary (export/model_card.FACT_KEYS)."""
        card = run_card_facts(self.to_dict())
        card["eval_loss"] = {kind: round(values["loss"], 4) for kind, values in self.heldout.items() if values}
        if self.robustness_scan:
            card["robustness_scan"] = self.robustness_scan
        warning = far_worse_warning(self.to_dict())
        if warning:
            card["warning"] = warning
        return card


def run_card_facts(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the model card's title and its "Tapering run" section show of a run (``report``: its report.json): the
    base model, the training data, its tokens and the schedule. taper's card and fold's card of the same run (read from
    its report.json) say the same; a field a hand edit gave another type, or a number that is not finite and >= 0,
    is left out, never a traceback."""
    model, data, taper, training = (_section(report, name) for name in ("model", "data", "taper", "training"))
    card: dict[str, Any] = {}
    base = model.get("source") if model.get("kind") == "hub" else model.get("name")
    if isinstance(base, str) and base:
        card["base_model"] = base
    if data:
        card["dataset"] = named_data(data)
    keep = taper.get("keep_norms")
    schedule = {
        "optimizer steps": _count(training.get("steps")),
        "taper start (step)": _count(taper.get("taper_start_step")),
        "taper end (step)": _count(taper.get("taper_end_step")),
        "recipe": taper.get("recipe"),
        "scope": taper.get("scope"),
        "kept norms": len(keep) if isinstance(keep, list) else None,
        "distillation weight": _count(taper.get("distill_weight")),
        "learning rate": _count(training.get("learning_rate")),
    }
    card["schedule"] = {key: value for key, value in schedule.items() if value is not None}
    tokens = _count(training.get("tokens"))
    if tokens:
        card["tokens"] = int(tokens)
    return card


def _count(value: Any) -> Optional[float]:
    """``value`` where it is a finite number >= 0 (a step, a token count, a weight or a rate); else None, which
    the card leaves out: Infinity, NaN or 1e400 (JSON that Python reads), a string or a bool from a hand edit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    finite = isinstance(value, int) or math.isfinite(value)  # a JSON integer past a float's range is exact
    return value if finite and value >= 0 else None


def _section(report: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = report.get(name)
    return section if isinstance(section, Mapping) else {}


def named_data(data: Mapping[str, Any]) -> str:
    """The training data as report.md and the model card name it (``data``: the report's data section): its name,
    with the configuration and the split where they are not the default (none; the train split): a run on
    ``--dataset_split test`` read other text than one on the train split of the same dataset."""
    config, split = data.get("config"), data.get("split")
    details = [
        *([f"configuration {config}"] if config else []),
        *([f"split {split}"] if split not in (None, "train") else []),
    ]
    source = str(data.get("source", "-"))
    return f"{source} ({', '.join(details)})" if details else source


def global_batch_blocks(training_args) -> int:
    """Blocks per optimizer step over every process: per device x accumulation x processes."""
    return (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * training_args.world_size
    )


#: The keys of :func:`reading_facts`, in the report's ``data`` section.
READING_KEYS = (
    "config",
    "split",
    "sample_by",
    "cache_dir",
    "dataset_path",
    "out_of_corpus_dataset",
    "out_of_corpus_text_column",
)


def reading_facts(data) -> dict[str, Any]:
    """How a command's data arguments (cli/arguments.DataArguments) read the text, beyond its name: the report
    records it for fold's scan. The places are recorded absolute (the cache folder; a local dataset's path, beside
    its name as typed, which the card shows): from another working or home folder, the name as typed may be
    another file."""
    cache = data.data_cache_dir
    values = (
        data.dataset_config_name,
        data.dataset_split,
        data.sample_by,
        str(expand_user(cache).absolute()) if cache else None,
        _absolute(data.dataset_name),
        _absolute(data.out_of_corpus_dataset) if data.out_of_corpus_blocks else None,
        data.out_of_corpus_text_column if data.out_of_corpus_blocks else None,
    )
    return dict(zip(READING_KEYS, values))


def evaluation_facts(data, packed, model) -> dict[str, Any]:
    """How an ``eval`` measured, beyond the model and the text's name: how the text was read (reading_facts, as the
    taper report records it), the held-out draw (its seed, the percentage of documents held out, the blocks drawn:
    ``packed``, the PackedData) and the dtype of the weights (``model``). Each changes the loss: results that differ
    in one must say so in their JSON, not only in their numbers."""
    return {
        **reading_facts(data),
        "heldout_seed": data.heldout_seed,
        "heldout_percentage": data.heldout_percentage,
        "heldout_blocks": len(packed.heldout),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def _absolute(name: Optional[str]) -> Optional[str]:
    """A local dataset's absolute path; a Hub dataset's name or the embedded corpus's (None) as it is."""
    local = local_dataset_path(name)
    return str(local.resolve()) if local is not None else name


def new_run_record(request, source, model, packed, config: TaperNormConfig, schedule, allowed_changes) -> RunRecord:
    """The record of a taper run about to train: its model (``source``, the loaded ``model``), data
    (``packed``: the PackedData), recipe, schedule (resolved) and the TrainingArguments of ``request``."""
    training_args = request.training
    return RunRecord(
        model=ModelFacts(
            source.describe(),
            source.name,
            source.kind,
            model.config.model_type,
            parameter_count(model),
            str(next(model.parameters()).dtype).removeprefix("torch."),
        ),
        data=DataFacts(
            packed.source,
            packed.text_column,
            packed.block_size,
            len(packed.train),
            len(packed.heldout),
            packed.heldout_tokens,
            request.data.heldout_percentage,
            request.data.heldout_seed,
            reading_facts(request.data),
        ),
        config=config,
        training=TrainingFacts(
            training_args.max_steps,
            global_batch_blocks(training_args),
            training_args.learning_rate,
            str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)),
            training_args.world_size,
            mixed_precision="bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None,
            precision=precision_line(training_args),
        ),
        taper_start_step=schedule.k_start,
        taper_end_step=schedule.k_end,
        allowed_changes=allowed_changes,
    )


#: A tapered or folded model this much worse (relative held-out CE) than its reference is a failed run, not a gap.
FAR_WORSE = 0.10
#: The budget docs/fidelity.md measured the default recipe with (its figures are there, not here).
MEASURED_BUDGET = "300 steps of 2 x 128 tokens or more (docs/fidelity.md)"


def far_worse_warning(facts: dict[str, Any]) -> Optional[str]:
    """One line when the tapered or folded model ends far worse on held-out text than the baseline (or, without one,
    the original), with the likely cause (the training budget) and the budget that measured well; else None."""
    heldout = facts.get("heldout") or {}
    against = "baseline" if heldout.get("baseline") else "original"
    reference = (heldout.get(against) or {}).get("loss")
    gaps = {
        kind: relative_gap((heldout.get(kind) or {}).get("loss"), reference)
        for kind in ("tapered", "folded")
        if heldout.get(kind)
    }
    worst = max(((gap, kind) for kind, gap in gaps.items() if gap is not None), default=None)
    if worst is None or worst[0] <= FAR_WORSE:
        return None
    gap, kind = worst
    training, data = facts.get("training") or {}, facts.get("data") or {}
    budget = (
        f"{training.get('steps') or training.get('max_steps')} steps of {training.get('global_batch_blocks')} x "
        f"{data.get('block_size')} tokens"
    )
    return (
        f"WARNING: the run failed to keep the model: the {kind} model is {100 * gap:+.1f}% worse than the {against} on "
        f"held-out text ({heldout[kind]['loss']:.4f} against {reference:.4f} nats per token); the likely cause is the "
        f"training budget ({budget}): the default recipe measured well with {MEASURED_BUDGET}"
    )


def relative_gap(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``value / reference - 1`` (e.g. +0.012 = 1.2% worse), or None when either is missing."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference - 1.0


def recorded_path(facts: dict[str, Any], run_folder: Path, recorded: Any) -> Optional[Path]:
    """Where a path that the report ``facts`` of the run in ``run_folder`` recorded is, from any working folder
    (None: no path recorded).

    An absolute path is itself, and ``~/...`` is in the home folder of the taper command (the one the report
    records; this command's for reports of earlier versions), never of whoever reads it now. A relative one is
    relative to the working folder of the taper command: the one the
    report records, else (reports of earlier versions) the one found from how the report named the run folder (its
    tapered/ or folded/ export's path, as typed) and where that folder is now, else the run folder. Never this
    command's working folder: it may hold another model at that path, which would be read in the run's place.
    """
    if not isinstance(recorded, str) or not recorded:
        return None
    home, parts = facts.get("home_folder"), Path(recorded).parts  # "." has no parts: the working folder
    if isinstance(home, str) and Path(home).is_absolute() and parts and parts[0] == "~":
        return Path(home, *parts[1:])
    path = expand_user(recorded, strict=False)  # recorded on another machine, a ~user may be unknown here
    if path.is_absolute():
        return path
    working = facts.get("working_folder")
    if isinstance(working, str) and Path(working).is_absolute():
        return Path(working) / path
    export = facts.get("export") or {}
    named = next((p for p in (export.get("tapered_checkpoint"), export.get("path")) if isinstance(p, str) and p), None)
    if named is None or Path(named).is_absolute():
        return run_folder / path
    return Path(os.path.normpath(run_folder / os.path.relpath(path, Path(named).parent)))


def differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved, current)}`` for every leaf that differs between two identities."""
    changed = {}
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed.update(differences(old, new, f"{prefix}{key}."))
        elif old != new:
            changed[f"{prefix}{key}"] = (old, new)
    return changed


__all__ = [
    "precision_line",
    "FAR_WORSE",
    "DataFacts",
    "ModelFacts",
    "RunRecord",
    "TrainingFacts",
    "differences",
    "evaluation_facts",
    "global_batch_blocks",
    "named_data",
    "new_run_record",
    "far_worse_warning",
    "recorded_path",
    "relative_gap",
]
