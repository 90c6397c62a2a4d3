"""The ``eval``, ``fold`` and ``push`` subcommands: each parses its arguments, checks them, then acts (where eval and
fold write is checked by cli/destinations.py, their local data paths by app/data_checks.py, and what fold's
robustness scan reads by cli/fold_scan.py).

``taper`` lives in app/taper.py (it is most of the package's orchestration) and ``bench`` in
bench/. What a command prints for the user (its result on stdout) is printed by the command itself: this
module, cli/main.py (usage, one-line errors), app/taper.py (the run's summary) and bench/runner.py
(the results table); everything else in the package logs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from .._parsing import UsageError, parse
from ..app.data_checks import check_data_paths, check_hub_datasets, output_target
from ..app.full_disk import full_disk_refused
from ..app.preflight import check_export_space
from ..app.record import evaluation_facts, run_card_facts
from ..app.run_export import warn_dropped_scan
from ..app.run_folder import RunFolder, write_file, write_folder
from ..app.run_folder_hints import eval_hint, fold_hint, push_hint, refuse_run_folder, scan_reference_hint
from ..app.run_lock import RunLock, refuse_while_running, resolved_path
from ..app.run_membership import not_the_runs
from ..app.run_tokenizer import tokenizer_of
from ..app.taper import save_export
from ..app.tapered_checks import check_recorded_sink, refuse_unfoldable_gate, refuse_unused_tied_head
from ..app.validation import check_same_tokenizer, check_vocabulary, check_within_positions
from ..config import sink_token_id
from ..data.corpus import blocks_tensor, prepare_from_arguments
from ..data.out_of_corpus import out_of_corpus_set
from ..errors import ConfigurationError, TaperStateError
from ..evaluation.models import (
    ModelSource,
    ModelSourceError,
    load_model,
    model_config,
    read_model_config,
    resolve_model,
)
from ..evaluation.scan import SCAN_FILE, robustness_scan, scan_line, scan_summary
from ..evaluation.scores import evaluate_set, heldout_loss
from ..export.folding import fold_model
from ..export.hub import push_export
from ..export.manifest import warn_changed_export
from ..export.readout import readout_facts
from ..layers.patching import gate_of, set_gate
from ..training.checkpoints import saved_gate, tapered_config_of
from ..utils import expand_user
from .arguments import DataArguments, EvalArguments, ModelArguments
from .destinations import (
    RESULT_MARK,
    check_export_folder,
    check_export_outside_models,
    check_result_file,
    check_result_outside_data,
    check_result_outside_models,
)
from .export_arguments import FoldArguments, PushArguments
from .fold_scan import (
    ScanTexts,
    check_export_outside_run,
    common_positions,
    fold_scan,
    names_a_reference,
    recorded_reference_of,
    run_report,
    scan_plan,
    scan_run_folder,
    scan_texts,
)

logger = logging.getLogger("hf_tapernorm.cli")


def _own_sink(source: ModelSource, hf_config) -> list[int]:
    """The sink tokens the model ``source`` was trained with, read before its weights load: a tapered checkpoint's
    from its tapernorm_config.json (load_tapered patches it with them), a folded export's from its config
    (``hf_config``; None where it could not be read); none for any other model."""
    if source.kind == "tapered":
        return list(tapered_config_of(source.path).sink_token_ids)
    return list(getattr(hf_config, "sink_token_ids", None) or [])


def _evaluation_sink(own_sink: list[int], tokenizer, sink: str, source) -> list[int]:
    """The sink every evaluation block starts with: a model trained with one (``own_sink``) is evaluated on blocks
    that start with it (a folded one holds it itself); ``--sink bos`` or ``none`` only where the model has no sink of
    its own."""
    if sink == "auto":
        sink_ids = own_sink
    elif sink == "none":
        sink_ids = []
    else:
        bos = sink_token_id(tokenizer)
        if bos is None:
            raise UsageError("--sink bos: the tokenizer has neither a BOS nor an EOS token; pass --sink none")
        sink_ids = [bos]
    if own_sink and sink_ids != own_sink:
        raise UsageError(f"'{source.path}' was trained with the sink {own_sink}; evaluate it with --sink auto")
    return sink_ids


def _to_gate_zero(model, source) -> None:
    """A tapered checkpoint is evaluated at g = 0, as the folded model would be (with a warning if saved above it)."""
    trained_gate = gate_of(model)
    try:
        set_gate(model, 0.0)
    except TaperStateError as error:
        raise UsageError(f"cannot evaluate '{source.path}' at g = 0: {error}") from None
    if trained_gate > 0.0:
        logger.warning(
            "%s was saved at gate %.4g; evaluating it at g = 0 as the folded model would be",
            source.path,
            trained_gate,
        )


def eval_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm eval``: held-out loss and perplexity of an original model, a tapered checkpoint
    (evaluated at g = 0) or a folded export, on the same held-out blocks as ``taper`` builds."""
    model_args, data_args, eval_args = parse([ModelArguments, DataArguments, EvalArguments], argv, "hf-tapernorm eval")
    output_json = _check_eval_arguments(model_args, data_args, eval_args)
    source = resolve_model(model_args.model_name_or_path, model_args.gguf_file, option="--model_name_or_path")
    block_size = data_args.block_size
    local = source.kind in ("folder", "folded")  # its unreadable config.json is the error, not the tokenizer's
    hf_config = (read_model_config if local else model_config)(source, model_args.trust_remote_code)
    check_within_positions(f"--block_size {block_size}", block_size, hf_config)
    tokenizer = tokenizer_of(source, trust_remote_code=model_args.trust_remote_code)
    if hf_config is not None:
        check_vocabulary(tokenizer, hf_config, source.describe())
    scan_reference = (
        scan_reference_of(source, eval_args.scan_reference, data_args.scan_windows) if data_args.scan_windows else None
    )
    if scan_reference is not None:
        _check_scan_reference(scan_reference, tokenizer, source, block_size, model_args.trust_remote_code)
    if source.kind == "tapered":  # checked before the weights load: a checkpoint that cannot go to g = 0
        tapered_config_of(source.path)
        check_recorded_sink(source.path)
    sink_ids = _evaluation_sink(_own_sink(source, hf_config), tokenizer, eval_args.sink, source)
    # The texts before the weights: a split or a text that fills no block is refused before the model loads.
    packed = prepare_from_arguments(data_args, tokenizer, train_blocks=0, prefix_ids=sink_ids)
    reference_text = out_of_corpus_set(data_args, tokenizer, sink_ids)
    model = load_model(
        source,
        dtype=model_args.dtype,
        trust_remote_code=model_args.trust_remote_code,
        trust_sharded_checkpoint=model_args.trust_sharded_checkpoint,
    )
    if source.kind == "tapered":
        _to_gate_zero(model, source)
    result = {
        "model": source.describe(),
        "kind": source.kind,
        "dataset": packed.source,
        "text_column": packed.text_column,
        **evaluation_facts(data_args, packed, model),  # its split, held-out draw, dtype, ...: what shapes the loss
        "block_size": packed.block_size,
        "sink_token_ids": sink_ids,
        **heldout_loss(
            model, blocks_tensor(packed.heldout), batch_size=data_args.eval_batch_size, prefix_length=len(sink_ids)
        ),
    }
    result["readout"] = readout_facts(model, blocks_tensor(packed.heldout)[:1])
    if reference_text is not None:
        scores = evaluate_set({"model": model}, reference_text, batch_size=data_args.eval_batch_size)["model"]
        result["out_of_corpus"] = {**scores.summary(), "text": reference_text.description}
    if scan_reference is not None:
        reference = load_model(scan_reference, dtype=model_args.dtype, trust_remote_code=model_args.trust_remote_code)
        texts = [t for t in (packed.heldout_set, reference_text) if t is not None]
        scan = robustness_scan(
            model,
            reference,
            texts,
            block_size=block_size,
            windows=data_args.scan_windows,
            max_positions=common_positions(model, reference),
            tokenizer=tokenizer,
            reference_name=scan_reference.describe(),
            seed=data_args.heldout_seed,
            batch_tokens=data_args.eval_batch_size * block_size,
        ).to_dict()
        result["robustness_scan"] = scan
    print(json.dumps(result))
    warning = scan_line(result.get("robustness_scan") or {}, where="robustness_scan in the result")
    if warning:
        print(warning)
    if output_json is not None:
        check_result_file(output_json)  # again: the evaluation took a while
        write_file(output_json, json.dumps({**result, "written_by": RESULT_MARK}, indent=2) + "\n")
    return 0


def _check_eval_arguments(model_args, data_args, eval_args) -> Optional[Path]:
    """eval's checks of its arguments, before anything is resolved or loaded; the --output_json path, if any."""
    _refuse_unread_scan_reference(eval_args.scan_reference, data_args.scan_windows)
    output_json = Path(eval_args.output_json) if eval_args.output_json else None
    if output_json is not None:
        check_result_file(eval_args.output_json)  # as given: a trailing '/' names a folder
        check_result_outside_data(output_json, data_args)
        models = {"--model_name_or_path": model_args.model_name_or_path, "--scan_reference": eval_args.scan_reference}
        check_result_outside_models(output_json, models)
    check_data_paths(data_args)  # the model loads before the data is read
    check_hub_datasets(data_args)
    refuse_run_folder(model_args.model_name_or_path, "--model_name_or_path", eval_hint)
    refuse_run_folder(eval_args.scan_reference, "--scan_reference", scan_reference_hint)
    return output_json


def _refuse_unread_scan_reference(scan_reference: Optional[str], windows: int) -> None:
    """Refuse ``--scan_reference`` with ``--scan_windows 0``: only the robustness scan reads it, and none runs, so it
    was ignored without a word (as any other option no part of the command reads is refused)."""
    if scan_reference is not None and not windows:
        raise UsageError(
            f"--scan_reference '{scan_reference}' is read only by the robustness scan, and --scan_windows 0 runs "
            "none: give --scan_windows N (N > 0) to scan against it, or leave --scan_reference out"
        )


def _check_scan_reference(reference, tokenizer, source, block_size: int, trust_remote_code: bool) -> None:
    """Refuse, before any model loads, a scan reference that cannot read the evaluated model's blocks: another
    tokenizer, or fewer positions than ``block_size`` (the scan failed with a traceback after the whole evaluation)."""
    check_same_tokenizer(tokenizer, source.describe(), reference, trust_remote_code=trust_remote_code)
    check_within_positions(
        f"--block_size {block_size} (the scan's reference '{reference.describe()}' reads it too)",
        block_size,
        model_config(reference, trust_remote_code),
    )


def scan_reference_of(source, named: Optional[str], windows: int) -> Optional[ModelSource]:
    """The model the scan (of ``windows`` windows) compares with: ``--scan_reference``, else the recorded baseline (or
    original) of the run whose tapered/ or folded/ folder ``source`` is; None (with a log line) when there is none to
    compare with."""
    if named is not None:
        return resolve_model(named, option="--scan_reference")
    if source.kind not in ("tapered", "folded"):
        return None
    run = scan_run_folder(source, "pass --scan_reference")
    if run is None:
        return None
    way_out = "name the model to compare with (--scan_reference), or evaluate with --scan_windows 0"
    facts = run_report(run)
    reference = recorded_reference_of(run, facts, windows, way_out)
    if reference is None and not names_a_reference(facts):  # else recorded_reference said why
        logger.warning(
            "no robustness scan: %s is not in a run folder that names a baseline or original model still there; pass "
            "--scan_reference",
            source.path,
        )
    return None if reference is None else reference[0]


def fold_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm fold``: a saved tapered checkpoint at g = 0 -> a folded export (numerically checked)."""
    (fold_args,) = parse([FoldArguments], argv, "hf-tapernorm fold")
    refuse_run_folder(fold_args.checkpoint, "--checkpoint", fold_hint)
    source = resolve_model(fold_args.checkpoint, option="--checkpoint")
    if source.kind == "hub":
        raise UsageError(
            f"--checkpoint '{fold_args.checkpoint}': no such folder; fold reads a local tapered checkpoint"
        )
    if source.kind != "tapered":
        raise UsageError(
            f"--checkpoint '{fold_args.checkpoint}' is not a tapered checkpoint (no tapernorm_config.json); "
            f"it is a {source.kind} model: pass a taper run's tapered/ or one of its checkpoint-N folders"
        )
    check_recorded_sink(source.path)  # these two before the weights load
    refuse_unfoldable_gate(source.path, saved_gate(source.path))
    refuse_unused_tied_head(source.path, fold_args.tied_head)
    output_dir = Path(fold_args.output_dir)
    destination = output_target("--output_dir", output_dir)  # a '..' after a missing folder: refused
    if destination == Path.cwd().resolve():
        raise UsageError(
            f"--output_dir '{output_dir}' is the working folder: fold writes its export beside the folder and renames "
            "it into place, which would pull the working folder from under this shell; name a folder of its own "
            "(--output_dir ./export)"
        )
    if destination.is_relative_to(resolved_path(source.path, f"--checkpoint '{fold_args.checkpoint}'")):
        raise UsageError(
            f"--output_dir '{output_dir}' lies inside --checkpoint '{fold_args.checkpoint}', which fold reads; "
            "choose a folder outside the checkpoint"
        )
    # an export inside an export, a model or a run (but as its folded/, and of that run's checkpoint)
    check_export_outside_models(output_dir, Path(source.path))
    check_export_folder(output_dir, fold_args.overwrite)
    check_export_space(output_dir, Path(source.path), fold_args.tied_head)  # before the weights load
    checkpoint = Path(source.path).resolve()  # a folder copied into a run's: that run's report is not its
    report = None if not_the_runs(checkpoint) else run_report(checkpoint.parent)  # the scan, the data, the card
    plan = scan_plan(source, fold_args.scan_windows, output_dir, report)  # and what the scan reads
    check_export_outside_run(source, output_dir, report)  # with or without a scan: the run's data stays as it read it
    card = _run_card_facts(source, report)
    tokenizer = _fold_tokenizer(source, fold_args.checkpoint)
    texts = scan_texts(plan, tokenizer, source)  # drawn before the weights load: a text that fills no block is refused
    export = RunFolder(output_dir)
    export.lock()  # held until the export is written: a second command into this folder is refused meanwhile
    try:
        check_export_folder(output_dir, fold_args.overwrite, locked=True)  # another command may have written it
        return _fold_into(output_dir, source, fold_args, (tokenizer, texts), card)
    finally:
        export.unlock()


def _fold_tokenizer(source: ModelSource, checkpoint: str):
    """The tokenizer fold exports with the checkpoint ``source`` (and its scan reads); None, with a log line, where
    there is none."""
    try:
        return tokenizer_of(source)
    except ModelSourceError:
        logger.warning("no tokenizer found with %s: the export has none", checkpoint)
        return None


def _fold_into(
    output_dir: Path, source: ModelSource, fold_args: FoldArguments, read: tuple[Any, Optional[ScanTexts]], card: dict
) -> int:
    """Fold the checkpoint ``source`` and write its export into ``output_dir`` (whose lock fold holds); ``read``: its
    tokenizer (None: none) and the robustness scan's texts and reference (scan_texts; None: no scan); ``card``:
    what the card says of the run."""
    tokenizer, texts = read
    model = load_model(source, trust_sharded_checkpoint=fold_args.trust_sharded_checkpoint)
    refuse_unfoldable_gate(source.path, gate_of(model))  # where the files did not tell (a sharded checkpoint)
    refuse_unused_tied_head(source.path, fold_args.tied_head, model)  # where its config and recipe could not tell
    folded = fold_model(model, tied_head=fold_args.tied_head, tolerance=fold_args.tolerance)
    scan = fold_scan(texts, folded, tokenizer)
    facts = {**card, **({"robustness_scan": scan} if scan else {})} or None
    with full_disk_refused(output_dir):  # replaces an earlier export, named in a WARNING after every refusal
        write_folder(
            output_dir,
            lambda tmp: save_export(folded, tokenizer, tmp, facts),
            before_write=lambda: _warn_replaced_export(output_dir, scans=bool(scan)),
        )
    print(json.dumps({"export": str(output_dir), "fold": folded.fold_report.to_dict()}))
    warning = scan_line(scan or {}, where=str(output_dir / SCAN_FILE))
    if warning:
        print(warning)
    return 0


def _warn_replaced_export(output_dir: Path, *, scans: bool) -> None:
    """fold --overwrite's WARNINGs of what its new export replaces, given once every check has passed (write_folder's
    before_write): files changed since the earlier export wrote them, and the earlier scan where this fold writes
    none (``scans``), as a run's --overwrite of its folded/ warns."""
    warn_changed_export(output_dir, f"--overwrite of '{output_dir}'")
    if not scans:
        warn_dropped_scan(output_dir, f"--overwrite of '{output_dir}' writes an export without a scan, and")


def _run_card_facts(source: ModelSource, report: Optional[dict]) -> dict:
    """What the export's card says of the taper run of the checkpoint ``source`` (``report``: its report.json), as
    taper's card of that run does: the base model (the card's title; else the checkpoint folder's name) and, for the
    run's own tapered/ checkpoint, the "Tapering run" section (a trainer checkpoint-N of the run had another
    schedule)."""
    run = Path(source.path).resolve().parent
    facts = run_card_facts(report) if report is not None else {}
    if Path(source.path).resolve() != run / "tapered":
        facts = {key: value for key, value in facts.items() if key == "base_model"}
    return facts


def _refuse_missing_export(export_dir: str) -> None:
    """Refuse an --export_dir that names nothing, whatever its form: a relative name is no Hub id to push (push
    uploads a local export), so it was not "a folded export (its config's model_type ...)" that was missing."""
    if not os.path.lexists(expand_user(export_dir)):
        raise UsageError(
            f"--export_dir '{export_dir}' not found: no such folder; name the folded export taper or fold wrote"
        )


def push_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm push``: upload the files an export wrote (its manifest) and the ``--include`` ones."""
    (push_args,) = parse([PushArguments], argv, "hf-tapernorm push")
    refuse_while_running(Path(push_args.export_dir), f"--export_dir '{push_args.export_dir}'")
    _refuse_missing_export(push_args.export_dir)  # after a loop on the way (resolved_path) is named as such
    refuse_run_folder(push_args.export_dir, "--export_dir", push_hint)
    source = resolve_model(push_args.export_dir, option="--export_dir", whole_export=True)
    if source.kind != "folded":
        raise UsageError(
            f"'{push_args.export_dir}' is not a folded export (its config's model_type is not tapernorm_*)"
        )
    with _holding_export(Path(source.path), f"--export_dir '{push_args.export_dir}'"):
        return _push_held(push_args, source)


@contextmanager
def _holding_export(folder: Path, what: str) -> Iterator[None]:
    """Hold the export's run lock while push checks and uploads it: upload_folder reads the files as it sends them,
    so a fold --overwrite, a taper --overwrite/--resume of its run or an export_folded(overwrite=True) replacing them
    meanwhile would publish a mix of two exports, or files other than those checked; each of them is refused while
    the lock is held, naming the push. The lock file is bookkeeping (never in the upload) and goes with the push,
    whatever its end; a killed push's is stale, taken over by the next command. A folder this user cannot write into
    is pushed without it: no command of this user can replace its files either."""
    if not os.access(folder, os.W_OK | os.X_OK):
        yield
        return
    refuse_while_running(folder, what)  # a command that took it since push's first look: named as push names one
    lock = RunLock(folder)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _push_held(push_args: PushArguments, source: ModelSource) -> int:
    """Check and upload the export ``source`` (whose lock push holds): its card, then push_export's checks."""
    if not (Path(source.path) / "README.md").is_file():
        raise UsageError(
            f"'{push_args.export_dir}' has no README.md model card; re-export it with hf-tapernorm taper or fold"
        )
    title, _, body = push_args.commit_message.partition("\n")  # a Hub commit's summary and description: git's
    try:
        commit = push_export(
            source.path,
            push_args.repo_id,
            include=push_args.include,
            before_upload=lambda files: print(_export_scan(Path(source.path))),  # once the export passed its checks
            token=push_args.token,
            private=push_args.private,
            commit_message=title,
            commit_description=body.strip("\n") or None,
        )
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - huggingface_hub/httpx raise many types; all mean "push failed"
        reason = str(error).splitlines()[0] if str(error) else ""
        raise UsageError(
            f"cannot push '{source.path}' to {push_args.repo_id}: {type(error).__name__}: {reason}; "
            "check the network (HF_HUB_OFFLINE must be unset) and your Hub token (HF_TOKEN or `hf auth login`)"
        ) from None
    print(f"pushed {source.path} to {getattr(commit, 'commit_url', push_args.repo_id)}")
    return 0


def _export_scan(folder: Path) -> str:
    """The export's robustness scan in one line (``robustness_scan.json``), or why there is none."""
    path = folder / SCAN_FILE
    if not path.is_file():
        return (
            f"{folder}: not scanned (fold writes a scan into an export: hf-tapernorm fold --checkpoint <run>/tapered "
            f"--output_dir {folder} --overwrite --scan_windows 16; eval's scan only prints its result)"
        )
    try:
        scan = json.loads(path.read_text())
        return ("WARNING: " if scan["broken"] else "") + f"{folder}: robustness scan: {scan_summary(scan)}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        return f"{folder}: {SCAN_FILE} is unreadable ({type(error).__name__})"


__all__ = ["eval_main", "fold_main", "push_main"]
