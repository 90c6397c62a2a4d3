"""The ``eval``, ``fold`` and ``push`` subcommands: each parses its arguments, checks them, then acts (where eval and
fold write is checked by cli/destinations.py, their local data paths by app/data_checks.py).

``taper`` lives in app/taper.py (it is most of the package's orchestration) and ``bench`` in
bench/. What a command prints for the user (its result on stdout) is printed by the command itself: this
module, cli/main.py (usage, one-line errors), app/taper.py (the run's summary) and bench/runner.py
(the results table); everything else in the package logs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .._parsing import UsageError, parse
from ..app.data_checks import check_data_paths, check_hub_datasets, missing_local_dataset
from ..app.preflight import check_export_space, full_disk_refused
from ..app.record import evaluation_facts, recorded_path, recorded_reference
from ..app.run_folder import RunFolder, write_file, write_folder
from ..app.run_lock import refuse_while_running, resolved_path
from ..app.taper import save_export
from ..app.tapered_checks import check_recorded_sink, refuse_unfoldable_gate
from ..app.validation import check_same_tokenizer, check_vocabulary, check_within_positions, fingerprint, max_positions
from ..config import sink_token_id
from ..data.corpus import blocks_tensor, prepare_from_arguments
from ..data.heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION
from ..data.out_of_corpus import out_of_corpus_set
from ..data.sources import EMBEDDED_CORPUS, DataError, local_dataset_path
from ..errors import ConfigurationError, TaperStateError
from ..evaluation.models import (
    ModelSource,
    ModelSourceError,
    load_model,
    load_tokenizer,
    model_config,
    read_model_config,
    resolve_model,
)
from ..evaluation.scan import SCAN_FILE, robustness_scan, scan_line, scan_summary
from ..evaluation.scores import evaluate_set, heldout_loss
from ..export.folding import fold_model
from ..export.hub import push_export
from ..export.readout import readout_facts
from ..layers.patching import gate_of, set_gate
from ..training.checkpoints import saved_gate, tapered_config_of
from ..utils import expand_user
from .arguments import DataArguments, EvalArguments, ModelArguments
from .destinations import (
    RESULT_MARK,
    check_export_folder,
    check_export_outside_data,
    check_result_file,
    check_result_outside_data,
)
from .export_arguments import FoldArguments, PushArguments

logger = logging.getLogger("hf_tapernorm.cli")


def _evaluation_sink(model, tokenizer, sink: str, source) -> list[int]:
    """The sink every evaluation block starts with: a model trained with one is evaluated on blocks that start with
    it (a folded one holds it itself); ``--sink bos`` or ``none`` only where the model has no sink of its own."""
    taper_config = getattr(model, "tapernorm_config", None)
    own_sink = list(
        getattr(model.config, "sink_token_ids", None) or (taper_config.sink_token_ids if taper_config else [])
    )
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
    output_json = Path(eval_args.output_json) if eval_args.output_json else None
    if output_json is not None:
        check_result_file(output_json)
        check_result_outside_data(output_json, data_args)
    check_data_paths(data_args)  # the model loads before the data is read
    check_hub_datasets(data_args)
    source = resolve_model(model_args.model_name_or_path, model_args.gguf_file)
    block_size = data_args.block_size
    local = source.kind in ("folder", "folded")  # its unreadable config.json is the error, not the tokenizer's
    hf_config = (read_model_config if local else model_config)(source, model_args.trust_remote_code)
    check_within_positions(f"--block_size {block_size}", block_size, hf_config)
    tokenizer = tokenizer_of(source, trust_remote_code=model_args.trust_remote_code)
    if hf_config is not None:
        check_vocabulary(tokenizer, hf_config, source.describe())
    scan_reference = scan_reference_of(source, eval_args.scan_reference) if data_args.scan_windows else None
    if scan_reference is not None:
        check_same_tokenizer(
            tokenizer, source.describe(), scan_reference, trust_remote_code=model_args.trust_remote_code
        )
    if source.kind == "tapered":  # checked before the weights load: a checkpoint that cannot go to g = 0
        tapered_config_of(source.path)
        check_recorded_sink(source.path)
    model = load_model(
        source,
        dtype=model_args.dtype,
        trust_remote_code=model_args.trust_remote_code,
        trust_sharded_checkpoint=model_args.trust_sharded_checkpoint,
    )
    sink_ids = _evaluation_sink(model, tokenizer, eval_args.sink, source)
    if source.kind == "tapered":
        _to_gate_zero(model, source)
    packed = prepare_from_arguments(data_args, tokenizer, train_blocks=0, prefix_ids=sink_ids)
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
    reference_text = out_of_corpus_set(data_args, tokenizer, sink_ids)
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
            max_positions=_common_positions(model, reference),
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


def tokenizer_of(source: ModelSource, *, trust_remote_code: bool = False):
    """The model's tokenizer; for a Trainer ``checkpoint-N`` of a taper run (the Trainer saves none there) the run's:
    its tapered/ export's, else the original model's that the run recorded. ModelSourceError when there is none."""
    try:
        return load_tokenizer(source, trust_remote_code=trust_remote_code)
    except ModelSourceError as error:
        folder = resolved_path(source.path, f"model '{source.path}'")
        if not folder.name.startswith("checkpoint-"):
            raise
        runs = [folder.parent, folder.parent.parent] if folder.parent.name == "baseline" else [folder.parent]
        for candidate in _run_tokenizer_sources(runs):
            try:
                tokenizer = load_tokenizer(candidate, trust_remote_code=trust_remote_code)
            except ModelSourceError:
                continue
            logger.info("%s holds no tokenizer: using its run's, from %s", source.path, candidate.describe())
            return tokenizer
        raise ModelSourceError(f"{error}; nor does its run folder hold one (tapered/, or the recorded model)") from None


def _run_tokenizer_sources(runs: list[Path]) -> list[ModelSource]:
    """Where a taper run's tokenizer is: each run folder's tapered/ export, then the original model it recorded."""
    sources = []
    for run in runs:
        if (run / "tapered" / "config.json").is_file():
            sources.append(resolve_model(str(run / "tapered")))
        identity = (RunFolder(run).manifest() or {}).get("identity") or {}
        recorded = identity.get("model")
        if isinstance(recorded, str) and _holds_recorded_model(recorded, identity.get("model_contents")):
            try:
                sources.append(resolve_model(recorded))
            except ModelSourceError:
                continue
    return sources


def _holds_recorded_model(recorded: str, contents: object) -> bool:
    """Whether the model path a run recorded (as typed) holds that model from this working folder: an absolute path
    that is there, or a relative one whose files are the ones the run recorded (``contents``). A relative path is
    relative to the taper's working folder, which the manifest does not record: from another folder it may name
    another model, whose tokenizer would score the checkpoint without a word."""
    path = expand_user(recorded, strict=False)  # recorded on another machine, a ~user may be unknown here
    if not path.exists():
        return False
    if path.is_absolute() or fingerprint(recorded, weights_by_size=True) == contents:
        return True
    logger.warning(
        "the run recorded its model as '%s', relative to the folder it was started in; '%s' here holds another model, "
        "whose tokenizer is not used",
        recorded,
        path.resolve(),
    )
    return False


def scan_reference_of(source, named: Optional[str]) -> Optional[ModelSource]:
    """The model the scan compares with: ``--scan_reference``, else the recorded baseline (or original) of the run
    whose tapered/ or folded/ folder ``source`` is; None (with a log line) when there is none to compare with."""
    if named is not None:
        return resolve_model(named)
    if source.kind not in ("tapered", "folded"):
        return None
    reference = _recorded_reference(Path(source.path).resolve().parent)
    if reference is None:
        logger.warning(
            "no robustness scan: %s is not in a run folder that names its baseline or original; pass --scan_reference",
            source.path,
        )
        return None
    return reference[0]


def fold_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm fold``: a saved tapered checkpoint at g = 0 -> a folded export (numerically checked)."""
    (fold_args,) = parse([FoldArguments], argv, "hf-tapernorm fold")
    source = resolve_model(fold_args.checkpoint)
    if source.kind == "hub":
        raise UsageError(
            f"--checkpoint '{fold_args.checkpoint}': no such folder; fold reads a local tapered checkpoint"
        )
    if source.kind != "tapered":
        raise UsageError(
            f"'{fold_args.checkpoint}' is not a tapered checkpoint (no tapernorm_config.json); "
            f"it is a {source.kind} model"
        )
    check_recorded_sink(source.path)  # these two before the weights load
    refuse_unfoldable_gate(source.path, saved_gate(source.path))
    output_dir = Path(fold_args.output_dir)
    destination = resolved_path(output_dir, f"--output_dir '{output_dir}'")
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
    check_export_folder(output_dir, fold_args.overwrite)
    check_export_space(output_dir, Path(source.path), fold_args.tied_head)  # before the weights load
    scan = _scan_plan(source, fold_args.scan_windows, output_dir)  # and what the scan reads
    export = RunFolder(output_dir)
    export.lock()  # held until the export is written: a second command into this folder is refused meanwhile
    try:
        check_export_folder(output_dir, fold_args.overwrite, locked=True)  # another command may have written it
        return _fold_into(output_dir, source, fold_args, scan)
    finally:
        export.unlock()


def _fold_into(output_dir: Path, source: ModelSource, fold_args: FoldArguments, scan_plan) -> int:
    """Fold the checkpoint ``source`` and write its export into ``output_dir`` (whose lock fold holds); ``scan_plan``:
    the robustness scan's data and reference (_scan_plan), None for no scan."""
    model = load_model(source, trust_sharded_checkpoint=fold_args.trust_sharded_checkpoint)
    refuse_unfoldable_gate(source.path, gate_of(model))  # where the files did not tell (a sharded checkpoint)
    folded = fold_model(model, tied_head=fold_args.tied_head, tolerance=fold_args.tolerance)
    try:
        tokenizer = tokenizer_of(source)
    except ModelSourceError:
        logger.warning("no tokenizer found with %s: the export has none", fold_args.checkpoint)
        tokenizer = None
    scan = _fold_scan(scan_plan, folded, tokenizer, fold_args.checkpoint)
    facts = {"robustness_scan": scan} if scan else None
    with full_disk_refused(output_dir):
        write_folder(output_dir, lambda tmp: save_export(folded, tokenizer, tmp, facts))  # replaces an earlier export
    print(json.dumps({"export": str(output_dir), "fold": folded.fold_report.to_dict()}))
    warning = scan_line(scan or {}, where=str(output_dir / SCAN_FILE))
    if warning:
        print(warning)
    return 0


def _scan_plan(
    source: ModelSource, windows: int, output_dir: Path
) -> Optional[tuple[DataArguments, tuple[ModelSource, str]]]:
    """What the robustness scan of a fresh export reads: the data and the reference its run recorded (None: no scan,
    with a log line saying why). Read before the weights load: a recorded local dataset that is gone is refused here,
    not after the load, the fold and its check, and so is an export (``output_dir``) that would land in one."""
    if not windows:
        return None
    run = Path(source.path).resolve().parent
    facts, reference = _run_report(run), _recorded_reference(run)
    if facts is None or reference is None:
        logger.warning(
            "no robustness scan: %s is not in a taper run folder that names its data and baseline or original; scan "
            "the export with hf-tapernorm eval --scan_reference",
            source.path,
        )
        return None
    recorded, sets = facts.get("data") or {}, facts.get("evaluation_sets") or {}
    ooc_set = sets.get("out-of-corpus") or {}
    ooc = recorded.get("out_of_corpus_dataset")
    if ooc is None and ooc_set and ooc_set.get("description") != PYTHON_DOCS_DESCRIPTION:
        logger.warning(  # a run of an earlier version, which did not record which text it was
            "the robustness scan has no out-of-corpus rows: the run in %s does not record its out-of-corpus dataset",
            run,
        )
        ooc_set = {}
    default = DataArguments()  # what the run used for anything its report does not record
    data = DataArguments(
        dataset_name=_recorded_dataset(facts, run, recorded.get("dataset_path", recorded.get("source")), windows),
        dataset_config_name=recorded.get("config"),
        dataset_split=recorded.get("split", default.dataset_split),
        sample_by=recorded.get("sample_by", default.sample_by),
        data_cache_dir=_recorded_cache(recorded.get("cache_dir")),
        text_column=recorded.get("text_column"),
        block_size=int(recorded.get("block_size", default.block_size)),
        heldout_percentage=float(recorded.get("heldout_percentage", default.heldout_percentage)),
        heldout_blocks=int((sets.get("held-out") or {}).get("blocks", default.heldout_blocks)),
        out_of_corpus_dataset=_recorded_dataset(facts, run, ooc, windows) or PYTHON_DOCS,
        out_of_corpus_text_column=recorded.get("out_of_corpus_text_column"),  # None in the runs of earlier versions
        out_of_corpus_blocks=int(ooc_set.get("blocks", 0)),  # no set recorded: none read
        scan_windows=windows,
    )
    check_export_outside_data(output_dir, data)  # it would become part of the run's texts
    try:  # a Hub dataset not in the cache, offline: refused now, as a local one that is gone
        check_data_paths(data)
        check_hub_datasets(data)
    except DataError as error:
        raise UsageError(f"--scan_windows {windows}: the run's text cannot be read ({error}); {_NO_SCAN}") from None
    return data, reference


#: The way out of a scan whose text cannot be read.
_NO_SCAN = "fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the export later, on any data)"


def _recorded_cache(recorded: Optional[str]) -> Optional[str]:
    """The datasets cache folder a run recorded, while it is there; else None (the default cache, as a command
    without --data_cache_dir), with a log line: fold never creates a folder its command line did not name."""
    if recorded and not Path(recorded).is_dir():
        logger.warning(
            "the run's datasets cache %s is gone: the scan reads its text through the default cache", recorded
        )
        return None
    return recorded


def _recorded_dataset(facts: dict, run: Path, recorded: Optional[str], windows: int) -> Optional[str]:
    """The dataset a run recorded (None: the embedded corpus), as fold finds it now: a local one where the run read
    it (recorded absolute; by runs of earlier versions as typed, found from the run's working and home folders:
    recorded_path), else a Hub dataset's name. A local one that is gone is refused before loading, never looked for
    from this command's working or home folder, which may hold another file of that name."""
    if recorded in (None, EMBEDDED_CORPUS, PYTHON_DOCS):
        return None
    recorded_where = "dataset_path" in (facts.get("data") or {})  # this version records a local one absolute
    if recorded_where and not Path(recorded).is_absolute():  # so this is a Hub dataset's name
        if local_dataset_path(recorded) is not None:  # the loader would read the local one in its place
            raise UsageError(
                f"--scan_windows {windows}: the run in '{run}' read the Hub dataset '{recorded}', and '{recorded}' "
                f"here is a local path, which would be read in its place; run fold from another folder, or {_NO_SCAN}"
            )
        return recorded
    local = recorded_path(facts, run, recorded)
    name = str(local) if local is not None and local.exists() else recorded  # else a Hub dataset's id
    if missing_local_dataset(name) is not None:
        raise UsageError(
            f"--scan_windows {windows}: the dataset '{local or name}' that the run in '{run}' recorded is not there; "
            f"restore it at that path, or {_NO_SCAN}"
        )
    return name


def _fold_scan(plan, folded, tokenizer, checkpoint: str) -> Optional[dict]:
    """The robustness scan of a fresh export (``plan``: _scan_plan's, None for none)."""
    if plan is None:
        return None
    if tokenizer is None:
        logger.warning("no robustness scan: %s has no tokenizer; scan the export with hf-tapernorm eval", checkpoint)
        return None
    data, reference = plan
    sink = list(getattr(folded.config, "sink_token_ids", None) or [])
    packed = prepare_from_arguments(data, tokenizer, train_blocks=0, prefix_ids=sink)
    texts = [t for t in (packed.heldout_set, out_of_corpus_set(data, tokenizer, sink)) if t is not None]
    model = load_model(reference[0])
    return robustness_scan(
        folded,
        model,
        texts,
        block_size=data.block_size,
        windows=data.scan_windows,
        max_positions=_common_positions(folded, model),
        tokenizer=tokenizer,
        reference_name=reference[1],
        seed=data.heldout_seed,
        batch_tokens=data.eval_batch_size * data.block_size,
    ).to_dict()


def _common_positions(*models) -> Optional[int]:
    limits = [n for n in (max_positions(m.config) for m in models) if n]
    return min(limits) if limits else None


def _run_report(folder: Path) -> Optional[dict]:
    """The report.json of the taper run folder ``folder``, or None."""
    try:
        facts = json.loads((folder / "report.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return facts if isinstance(facts, dict) else None


def _recorded_reference(run: Path) -> Optional[tuple[ModelSource, str]]:
    """The model the scan of the run in ``run`` compares with, and its name ("baseline" or "original"), found
    from any working folder (app/record.recorded_reference); None without a report or such a model."""
    facts = _run_report(run)
    found = recorded_reference(facts, run) if facts is not None else None
    return (resolve_model(str(found[0])), found[1]) if found is not None else None


def push_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm push``: upload the files an export wrote (its manifest) and the ``--include`` ones."""
    (push_args,) = parse([PushArguments], argv, "hf-tapernorm push")
    refuse_while_running(Path(push_args.export_dir), f"--export_dir '{push_args.export_dir}'")
    source = resolve_model(push_args.export_dir)
    if source.kind != "folded":
        raise UsageError(
            f"'{push_args.export_dir}' is not a folded export (its config's model_type is not tapernorm_*)"
        )
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
        return f"{folder}: not scanned (hf-tapernorm eval --scan_reference <the base model> scans it)"
    try:
        scan = json.loads(path.read_text())
        return ("WARNING: " if scan["broken"] else "") + f"{folder}: robustness scan: {scan_summary(scan)}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        return f"{folder}: {SCAN_FILE} is unreadable ({type(error).__name__})"


__all__ = ["eval_main", "fold_main", "push_main"]
