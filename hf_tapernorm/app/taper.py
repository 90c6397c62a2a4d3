"""The ``taper`` pipeline: validate everything, then train, evaluate, fold, export and report.

Order matters for a user's time and files. Everything that can be checked without the weights is checked first:
the arguments, the output folder, the model's config and tokenizer (the recipe is planned on a weightless copy of
the model, so a bad ``keep_norms`` or an unsupported layout fails in seconds), the schedule against ``max_steps``,
the block size against the model's positions, the identity of a resumed run, and the data. Only then are the
weights loaded and the output folder emptied (the checks: validation.py). The run itself is the library path:
``patch_model(model, config)`` + ``Trainer`` + ``TaperCallback()``, with two bookkeeping callbacks (Ctrl-C, the run
record) that do not touch training. An experiment adds its own callback, loss terms, log keys and training data
through a ``TaperExtension`` (extension.py), passed to ``run_taper``.
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from ..data.corpus import PackedData, blocks_tensor, prepare_from_arguments
from ..data.heldout import EvaluationSet
from ..data.out_of_corpus import out_of_corpus_set
from ..errors import ConfigurationError, TaperStateError
from ..evaluation.models import ModelSource, load_model, load_tokenizer, resolve_model
from ..evaluation.scan import SCAN_FILE, robustness_scan, scan_line
from ..evaluation.scores import broken_blocks, evaluate_set, per_document
from ..export.folding import fold_model
from ..export.manifest import recording_export
from ..export.writing import export_folded
from ..layers.patching import gate_of, patch_model, plan_patch
from ..layers.scale_anchor import scale_anchors
from ..layers.taper_norm import tapered_norms
from ..training.calibration import calibration_table
from ..training.checkpoints import save_tapered
from ..training.schedule import decay_learning_rate_after_the_taper
from .data_checks import check_hub_datasets
from .epochs import blocks_trained, check_accumulation_within_epoch
from .extension import TaperExtension, TrainingData, TrainingInputs
from .fingerprints import weights_and_config
from .full_disk import full_disk_refused
from .preflight import check_disk_space, check_trainer_options, check_training_blocks
from .record import RunRecord, far_worse_warning, global_batch_blocks, new_run_record, precision_line
from .report import PLOTS, summary_lines, write_report
from .run_folder import RunFolder, inside_folder, write_file
from .run_membership import check_resumed_baseline
from .run_preparation import check_run_folder, finished_run, prepare_run_folder
from .showcase import greedy_continuations, ops_per_generated_token
from .training_run import LOG_KEYS, LOSS_TERM_KEYS, RecordCallback, resume_advice, train
from .validation import (
    TaperRequest,
    check_baseline_identity,
    check_lengths_within_positions,
    check_resume_identity,
    check_schedule,
    check_vocabulary,
    fit_default_schedule,
    fit_default_warmup,
    max_positions,
    recipe_config,
    run_identity,
    weightless_model,
)

logger = logging.getLogger(__name__)


# ============================================================================= the run
def run_taper(request: TaperRequest, extension: Optional[TaperExtension] = None) -> int:
    """The whole ``taper`` command on parsed arguments; returns the exit status (0, or 128 + the signal's number
    when SIGINT/SIGTERM stopped it with a checkpoint: 130, 143). ``extension``: an experiment's extra training
    parts (extension.py)."""
    logger.info("%s", precision_line(request.training))  # first: the same command trains otherwise elsewhere
    state = PartialState()
    cache = inside_folder(request.data.data_cache_dir, request.training.output_dir)  # a cache the run adopts
    output = RunFolder(request.training.output_dir, outputs=RUN_OUTPUTS, adopted=cache)
    if state.is_main_process:
        output.lock()  # a second command on this folder is refused until this one ends
    try:
        return _run_locked(request, output, extension or TaperExtension())
    finally:
        output.unlock()


def _run_locked(request: TaperRequest, output: RunFolder, extension: TaperExtension) -> int:
    started = time.time()
    state = PartialState()
    training_args, run = request.training, request.run
    source = resolve_model(request.model.model_name_or_path, request.model.gguf_file, option="--model_name_or_path")
    if source.kind in ("tapered", "folded"):
        raise ConfigurationError(
            f"'{source.path}' is already a {source.kind} model; taper starts from an ordinary model"
        )
    must_empty, stale_checkpoints = check_run_folder(request, output, source)
    check_hub_datasets(request.data)  # it writes into the datasets cache: after every check that writes nothing

    tokenizer = load_tokenizer(source, trust_remote_code=request.model.trust_remote_code)
    skeleton = weightless_model(source, request.model.trust_remote_code)
    check_vocabulary(tokenizer, skeleton.config, source.describe())
    config = extension.recipe(recipe_config(request, skeleton, tokenizer))
    config = fit_default_schedule(config, request.taper, training_args.max_steps)
    plan_patch(skeleton, config)  # every keep pattern, every norm: refused now, not after the load
    schedule = check_schedule(config, training_args.max_steps)
    fit_default_warmup(training_args, schedule)
    decay_learning_rate_after_the_taper(training_args, schedule)  # the baseline trains with the same schedule
    check_trainer_options(training_args, schedule, config)
    check_lengths_within_positions(request.data, skeleton.config)
    if not run.resume:  # a resumed run has written part of it already: no lower bound to check
        check_disk_space(
            output.path,
            skeleton,
            training_args,
            config,
            dtype=request.model.dtype,
            baseline=run.baseline,
            reclaimable=output.reclaimable_bytes() if must_empty else 0,
        )
    identity = run_identity(request, source, config, extension.data_facts)
    baseline_source = resolve_baseline(request.run.baseline_from)
    if baseline_source is not None:
        check_baseline_identity(baseline_source, identity)
    allowed_changes = {}
    if run.resume:
        allowed = {name.strip() for name in (run.allow_changes or "").split(",") if name.strip()}
        allowed_changes = check_resume_identity(output, identity, allowed)
        if baseline_source is not None:
            check_resumed_baseline(output.path, Path(baseline_source.path))

    packed = prepare_run_data(request, tokenizer, config.sink_token_ids)
    check_training_blocks(training_args, len(packed.train))
    inputs = TrainingInputs(packed, request.data, training_args, tokenizer, skeleton.config)
    training_data = extension.build_training_data(inputs)  # what both trainings read; its refusals come now
    check_accumulation_within_epoch(training_args, training_data.dataset)
    del skeleton
    reference_text = out_of_corpus_set(request.data, tokenizer, config.sink_token_ids)
    model = load_model(source, dtype=request.model.dtype, trust_remote_code=request.model.trust_remote_code)
    if state.is_main_process:
        stale = stale_checkpoints if run.resume else None
        with full_disk_refused(output.path, "what the run writes", then=lambda: resume_advice(output.path)):
            prepare_run_folder(output, must_empty, stale, identity, scans=bool(request.data.scan_windows))
    state.wait_for_everyone()

    record = new_run_record(request, source, model, packed, config, schedule, allowed_changes)
    record.data.extension.update({**extension.data_facts, **training_data.facts})
    record.add_evaluation_sets(packed.heldout_set, reference_text)
    if baseline_source is not None:
        record.export["baseline_model"] = str(Path(baseline_source.path).resolve())  # found from any folder
        record.export["baseline_contents"] = weights_and_config(baseline_source.path)  # what a scan compares with
    pipeline = _Pipeline(request, record, packed, tokenizer, output, identity, source, reference_text, baseline_source)
    pipeline.extension, pipeline.training_data = extension, training_data  # the baseline: its data, no parts
    with full_disk_refused(output.path, "what the run writes", then=lambda: resume_advice(output.path)):
        return _run_recorded(pipeline, model, started)


def _run_recorded(pipeline: _Pipeline, model, started: float) -> int:
    """``pipeline.run(model)``; a failure is recorded in the run's report (the exception's own type and text) before
    it propagates: a full disk then becomes one line (full_disk_refused, around this)."""
    record, output, state = pipeline.record, pipeline.output, pipeline.state
    try:
        return pipeline.run(model)
    except BaseException as error:  # divergence, fold check, Ctrl-C outside training: say so, export nothing
        if state.is_main_process:
            record.status = f"failed: {type(error).__name__}: {error}"
            if record.history and record.training.steps is None:  # how far training got
                last = record.history[-1]
                record.training.steps, record.training.final_gate = last["step"], last.get("gate")
            if pipeline.request.run.resume and finished_run(output.path):  # its results stand: only --resume failed
                logger.warning("the run in %s had finished: its report stays as it was", output.path)
            else:
                write_run_report(output, record)
            print("\n".join(["", "hf-tapernorm taper: summary (no export)", *summary_lines(record.to_dict())]))
        raise
    finally:
        logger.info("taper: %.0f s in all", time.time() - started)


def prepare_run_data(request: TaperRequest, tokenizer, sink_ids: list[int]) -> PackedData:
    """The training blocks for ``max_steps`` global batches and the held-out set."""
    blocks = request.training.max_steps * global_batch_blocks(request.training)
    return prepare_from_arguments(request.data, tokenizer, train_blocks=blocks, prefix_ids=sink_ids)


def resolve_baseline(path: Optional[str]) -> Optional[ModelSource]:
    """The normalized model that ``--baseline_from`` names: a run folder's ``baseline/model``, or a model folder."""
    if path is None:
        return None
    folder = Path(path)
    if (folder / "baseline" / "model").is_dir():
        folder = folder / "baseline" / "model"
    if not (folder / "config.json").is_file():
        raise ConfigurationError(
            f"--baseline_from '{path}' holds no model: name the folder of an earlier --baseline run "
            "(its baseline/model) or a saved model folder"
        )
    source = resolve_model(str(folder), option="--baseline_from")
    if source.kind != "folder":
        raise ConfigurationError(
            f"--baseline_from '{path}' is a {source.kind} model; it must name an earlier --baseline run "
            "(or its baseline/model folder)"
        )
    return source


class _Pipeline:
    """(Baseline,) tapered training, fold, export, evaluation and report of one run."""

    def __init__(
        self,
        request,
        record: RunRecord,
        packed: PackedData,
        tokenizer,
        output: RunFolder,
        identity,
        source: ModelSource,
        reference_text: Optional[EvaluationSet],
        baseline_source: Optional[ModelSource],
    ) -> None:
        self.request, self.record, self.packed, self.tokenizer = request, record, packed, tokenizer
        self.output, self.identity, self.source = output, identity, source
        self.reference_text, self.baseline_source = reference_text, baseline_source
        self.state = PartialState()
        self.heldout, self.training_data = blocks_tensor(packed.heldout), TrainingData(packed.train)
        self.extension = TaperExtension()

    def train(self, model, folder: Path, callbacks: list, history: list, extended: bool = False):
        """One training into ``folder``; ``extended``: with the extension's log keys and loss terms."""
        callbacks = [*callbacks, RecordCallback(self.output, self.identity)]
        keys, terms = LOG_KEYS, LOSS_TERM_KEYS
        if extended:
            keys = {**LOG_KEYS, **self.extension.log_keys}
            terms = (*LOSS_TERM_KEYS, *self.extension.loss_terms)
        return train(
            model,
            self.request.training,
            self.training_data.dataset,
            folder,
            callbacks,
            resume=self.request.run.resume,
            history=history,
            log_keys=keys,
            loss_terms=terms,
        )

    def prompts(self, count: int = 3, length: int = 32) -> torch.Tensor:
        """Held-out prompts (sink tokens included) for the report's side-by-side continuations."""
        return self.heldout[:count, : len(self.packed.prefix_ids) + length]

    def run(self, model) -> int:
        record, main = self.record, self.state.is_main_process
        if main:
            record.ops["original"] = ops_per_generated_token(model, self.prompts(1))
        baseline = copy.deepcopy(model) if self.request.run.baseline else None
        patch_model(model, record.config)
        record.tapered_norms = sum(1 for _ in tapered_norms(model))
        allowed = {key.rsplit(".", 1)[-1] for key in record.allowed_changes if key.startswith("taper.")}
        callback = self.extension.taper_callback(
            allow_changes=allowed, trust_sharded_checkpoint=self.request.model.trust_sharded_checkpoint
        )
        callbacks = [callback, *self.extension.callbacks]
        trainer, interrupted = self.train(model, self.output.path, callbacks, record.history, extended=True)
        if interrupted:
            return self.interrupted(f"interrupted at step {trainer.state.global_step}", interrupted)
        steps, block_size = trainer.state.global_step, self.packed.block_size
        record.training.steps = steps
        blocks = blocks_trained(self.request.training, self.training_data.dataset, steps)  # epochs' short last steps
        record.training.tokens = self.training_data.tokens(steps) if self.training_data.tokens else blocks * block_size
        record.training.seconds = (
            trainer.state.log_history[-1].get("train_runtime") if trainer.state.log_history else None
        )
        record.training.final_gate = gate_of(model)
        anchors = scale_anchors(model)
        if anchors and anchors[0].is_frozen:
            record.scale_target = float(anchors[0].target)
        record.calibration = calibration_table(model)
        if baseline is not None:
            record.baseline_history = []
            trainer, interrupted = self.train(baseline, self.output.path / "baseline", [], record.baseline_history)
            if interrupted:
                return self.interrupted(
                    f"interrupted in the baseline run at step {trainer.state.global_step}", interrupted
                )
            if main:
                self.save_baseline(baseline)
        if main:
            with model_dtype_only(model):
                self.finish(model, baseline)
        self.state.wait_for_everyone()
        return 0

    def save_baseline(self, baseline) -> None:
        """The normalized run's model (``baseline/model``), so later runs and reports can compare with it."""

        def write(tmp: Path) -> None:
            baseline.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)

        folder = self.output.write_output("baseline/model", write)
        self.record.export["baseline_model"] = str(folder.resolve())  # found from any working folder
        self.record.export["baseline_contents"] = weights_and_config(str(folder))

    def load(self, source: ModelSource):
        model = load_model(
            source, dtype=self.request.model.dtype, trust_remote_code=self.request.model.trust_remote_code
        )
        return model.to(self.state.device)

    def finish(self, model, baseline) -> None:
        record = self.record
        self.output.write_output("tapered", lambda tmp: save_tapered(model, tmp, self.tokenizer))
        record.export["tapered_checkpoint"] = str(self.output.path / "tapered")
        probe = self.heldout[:2, len(self.packed.prefix_ids) :]
        folded = fold_model(model, tied_head=self.request.taper.tied_head, probe=probe)
        record.fold = folded.fold_report.to_dict()
        record.ops["folded"] = ops_per_generated_token(folded, self.prompts(1))
        if baseline is None and self.baseline_source is not None:
            baseline = self.load(self.baseline_source)
        self.evaluate_all(model, baseline, folded)  # before the export: its model card shows the figures
        self.export(folded, probe)
        models = {"baseline": baseline} if baseline is not None else {}
        models.update(tapered=model, folded=folded)
        record.samples = greedy_continuations(models, self.prompts(), self.tokenizer, sink=self.packed.prefix_ids)
        record.status = "finished"
        write_run_report(self.output, record)
        self.output.record(identity=self.identity)
        print(
            "\n".join(
                [
                    "",
                    "hf-tapernorm taper: summary",
                    *summary_lines(record.to_dict()),
                    f"report: {self.output.path / 'report.md'}",
                ]
            )
        )
        warning = scan_line(record.robustness_scan, where=str(self.output.path / "report.md"))
        if warning:
            print(warning)
        failed = far_worse_warning(record.to_dict())
        if failed:
            print(failed)

    def evaluate_all(self, model, baseline, folded) -> None:
        """Every model on the held-out and the out-of-corpus blocks in one pass each, with the KL to the original.

        The original is loaded again from its source (the run trained the first copy); the per-block
        losses go to ``heldout_losses.json`` so that runs can be compared block by block.
        """
        record, batch = self.record, self.request.data.eval_batch_size
        original = self.load(self.source)
        models = {"original": original, **({"baseline": baseline} if baseline is not None else {})}
        models.update(tapered=model, folded=folded)
        held = evaluate_set(models, self.packed.heldout_set, reference=original, batch_size=batch)
        record.heldout = {name: scores.summary() for name, scores in held.items()}
        against = "baseline" if baseline is not None else "original"
        record.heldout_documents = {
            "against": against,
            "rows": per_document(held["tapered"], held[against], self.packed.heldout_set),
            "broken_blocks": broken_blocks(held["tapered"], held[against]),
        }
        losses = {"blocks": len(self.packed.heldout_set.blocks), **{name: s.per_block() for name, s in held.items()}}
        self.output.record(expect=[HELDOUT_LOSSES])
        write_file(self.output.path / HELDOUT_LOSSES, json.dumps(losses) + "\n")
        if self.reference_text is not None:
            scores = evaluate_set(models, self.reference_text, reference=original, batch_size=batch)
            record.out_of_corpus = {name: s.summary() for name, s in scores.items()}
            record.out_of_corpus_blocks = {
                "against": against,
                "broken_blocks": broken_blocks(scores["tapered"], scores[against]),
            }
        self.scan(folded, models[against], against)
        del original

    def scan(self, folded, reference, reference_name: str) -> None:
        """The robustness scan of the folded model against ``reference`` (evaluation/scan.py), on both sets."""
        data = self.request.data
        texts = [t for t in (self.packed.heldout_set, self.reference_text) if t is not None]
        if not data.scan_windows or not texts:
            return
        result = robustness_scan(
            folded,
            reference,
            texts,
            block_size=self.packed.block_size,
            windows=data.scan_windows,
            max_positions=max_positions(folded.config),
            tokenizer=self.tokenizer,
            reference_name=reference_name,
            seed=data.heldout_seed,
            batch_tokens=data.eval_batch_size * self.packed.block_size,
        )
        self.record.robustness_scan = result.to_dict()

    def export(self, folded, probe) -> None:
        """Write the export atomically, reload it and compare it with the folded model in memory."""
        record, folded_dir = self.record, self.output.path / "folded"
        logger.info("saving the folded export to %s", folded_dir)
        self.output.write_output("folded", lambda tmp: save_export(folded, self.tokenizer, tmp, record.card_facts()))
        reloaded = AutoModelForCausalLM.from_pretrained(folded_dir).eval()
        with torch.no_grad():
            expected = folded.eval()(input_ids=probe).logits
            got = reloaded(input_ids=probe.to(reloaded.device)).logits
        difference = float((got.double() - expected.double()).abs().max())
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            raise TaperStateError(
                f"the folded export in {folded_dir} does not reload to the same model "
                f"(max |logit diff| {difference:.3g})"
            )
        record.export.update({"path": str(folded_dir), "reloaded": True, "reload_max_abs_diff": difference})

    def interrupted(self, what: str, signal_name: str) -> int:
        if self.state.is_main_process:
            self.record.status = f"{what}; continue with --resume"
            write_run_report(self.output, self.record)
            print(f"{what}: checkpoint saved in {self.output.path}; rerun the same command with --resume to continue")
        return 128 + int(getattr(signal, signal_name))


#: What a taper run writes besides its checkpoints (folders end in "/"; runs/: the Trainer's TensorBoard logs).
REPORT_FILES = ("report.json", "report.md", *PLOTS.values())
HELDOUT_LOSSES = "heldout_losses.json"
RUN_OUTPUTS = (*REPORT_FILES, HELDOUT_LOSSES, "tapered/", "folded/", "baseline/", "runs/")


def write_run_report(output: RunFolder, record: RunRecord) -> None:
    """The report, its files registered in the manifest before they are written (a kill leaves none foreign)."""
    output.record(expect=REPORT_FILES)
    write_report(output.path, record)
    output.record()


def model_dtype_only(model):
    """No autocast around evaluation, folding, the fold check and the sink capture: they run in the model's dtype."""
    return torch.autocast(device_type=next(model.parameters()).device.type, enabled=False)


def save_export(folded, tokenizer, folder: Path, facts: Optional[dict[str, Any]] = None) -> None:
    """Weights, config, modeling code, model card and tokenizer (export_folded), plus the robustness scan
    (``robustness_scan.json``, when ``facts`` holds one: ``push`` reports it); all in its manifest."""
    export_folded(folded, folder, tokenizer=tokenizer, facts=facts)
    scan = (facts or {}).get("robustness_scan")
    if scan:
        with recording_export(folder):
            write_file(folder / SCAN_FILE, json.dumps(scan, indent=2) + "\n")


__all__ = [
    "TaperExtension",
    "TaperRequest",
    "TrainingData",
    "TrainingInputs",
    "prepare_run_data",
    "recipe_config",
    "resolve_baseline",
    "run_taper",
    "save_export",
]
