"""``fold`` and ``eval`` on a finished run: paths as users type them ('~' quoted, a trailing slash), a Trainer
checkpoint that reads the run's tokenizer, a destination that cannot be written (or whose disk cannot hold the
export) refused before loading, a disk that fills up during the write as one line, an --overwrite of the run's own
export that writes the same model, and the scan's reference (the run's baseline) found from any working folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import SafetensorError

from hf_tapernorm import (
    ConfigurationError,
    export_folded,
    fold_model,
)
from hf_tapernorm.app.run_folder import MANIFEST_NAME
from hf_tapernorm.app.training_run import IDENTITY_NAME as IDENTITY
from hf_tapernorm.cli import fold_scan
from hf_tapernorm.data import DataError, load_text_dataset
from hf_tapernorm.evaluation.models import ModelSourceError, load_model, load_tokenizer, resolve_model
from tests.conftest import corpus_documents, save_tiny_model
from tests.helpers import (
    cached_hub_dataset,
    edit_json,
    finished_run,
    hub_offline,
    one_model_workspace,
    refused,
    run_main,
    tapered,
)
from tests.helpers import copy_run as copy_of
from tests.helpers import short_eval_argv as evaluate
from tests.helpers import short_fold_argv as fold
from tests.helpers import short_taper_argv as taper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("fold_and_eval"))


@pytest.fixture(scope="module")
def baseline_run(ws) -> Path:
    """A finished 6-step run with --baseline (checkpoint-6, tapered/, folded/, baseline/, report.json)."""
    return finished_run(taper(ws, ws / "run", "--baseline"))


@pytest.fixture(scope="module")
def run(baseline_run) -> Path:
    """The finished run, as the cases that read only its tapered/ and folded/ call it."""
    return baseline_run


# ============================================================================= paths as typed
def test_fold_eval_and_export_read_a_quoted_home_path(run, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run_main(fold(run / "tapered", "~/export"))[0] == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
    code, _, stderr = run_main(evaluate(run / "folded", "--output_json", "~/result.json"))
    assert code == 0, stderr[-2000:]
    assert json.loads((tmp_path / "result.json").read_text())["kind"] == "folded"
    assert export_folded(fold_model(tapered("llama")), "~/api_export") == tmp_path / "api_export"
    assert not (tmp_path / "~").exists()


def test_a_home_folder_this_machine_does_not_know_is_one_line_naming_the_path_as_typed(tmp_path, monkeypatch):
    """``~nosuchuser/x`` (a user this machine does not have) ended in Path.expanduser's bare "RuntimeError: Could
    not determine home directory." wherever a path was expanded; ``~`` and a known ``~user`` still expand."""
    import pwd

    from hf_tapernorm.app.scan_reference import recorded_reference
    from hf_tapernorm.errors import ConfigurationError
    from hf_tapernorm.utils import expand_user, expand_user_options

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert expand_user("~/x") == tmp_path / "x" and expand_user(Path("~")) == tmp_path
    assert expand_user(f"~{pwd.getpwuid(os.getuid()).pw_name}/x") == Path(pwd.getpwuid(os.getuid()).pw_dir) / "x"
    assert expand_user("a/~b") == Path("a/~b")
    with pytest.raises(ConfigurationError) as refused:
        expand_user("~nosuchuser/x")
    assert str(refused.value) == (
        "'~nosuchuser/x': there is no user 'nosuchuser' on this machine, so '~nosuchuser' names no home folder; "
        "write the path in full, or start it with ~/ for your own home folder"
    )
    with pytest.raises(ConfigurationError, match=r"^--data_cache_dir '~nosuchuser': there is no user 'nosuchuser'"):
        expand_user_options(
            SimpleNamespace(dataset_name=None, data_cache_dir="~nosuchuser"), "dataset_name", "data_cache_dir"
        )
    assert expand_user("~nosuchuser/x", strict=False) == Path("~nosuchuser/x")  # a run's record, from another machine
    assert recorded_reference({"model": {"kind": "folder", "source": "~nosuchuser/m"}}, tmp_path) is None
    assert run_main(fold(tmp_path / "none", "~nosuchuser/export"))[0] == 2
    assert list(tmp_path.iterdir()) == []  # no folder named "~nosuchuser" in the working folder

    def no_entry(uid: int):  # a uid the password database does not list (a container's arbitrary user)
        raise KeyError(uid)

    monkeypatch.delenv("HOME")
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(
        ConfigurationError, match=r"^'~/x': this machine names no home folder for '~' \(HOME is unset\)"
    ):
        expand_user("~/x")


def test_fold_of_a_checkpoint_with_a_trailing_slash_and_eval_in_float16(run, tmp_path):
    assert run_main(fold(str(run / "checkpoint-6") + "/", tmp_path / "export"))[0] == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "tapernorm_llama"
    code, out, _ = run_main(evaluate(run / "folded", "--dtype", "float16"))
    assert code == 0 and json.loads(out.splitlines()[0])["kind"] == "folded"


def test_a_checkpoint_s_tokenizer_is_never_read_from_another_model_at_the_recorded_relative_path(
    ws, baseline_run, tmp_path, monkeypatch, caplog
):
    """An interrupted run (no tapered/) whose model was named relative to where taper ran: eval of its checkpoint
    from another folder read the tokenizer of whatever model that relative path named there, without a word."""
    run = copy_of(baseline_run, tmp_path)
    shutil.rmtree(run / "tapered")
    manifest = json.loads((run / MANIFEST_NAME).read_text())
    manifest["identity"]["model"] = "llama"  # as `taper --model_name_or_path llama` from ws records it
    (run / MANIFEST_NAME).write_text(json.dumps(manifest))
    for record in run.glob("checkpoint-*/tapernorm_run.json"):  # and each checkpoint's own record
        record.write_text(json.dumps({**json.loads(record.read_text()), "model": "llama"}))
    argv = evaluate(next(run.glob("checkpoint-*")), data=ws / "corpus.txt")
    monkeypatch.chdir(ws)  # where the run was started: the same model there
    code, stdout, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    assert "relative to the folder it was started in" not in stderr
    other = tmp_path / "elsewhere"
    save_tiny_model(other / "llama", "llama", seed=1)
    monkeypatch.chdir(other)
    code, _, stderr = run_main(argv)
    assert code == 2
    assert "the run recorded its model as 'llama', relative to the folder it was started in; " in caplog.text
    assert (
        stderr.strip().splitlines()[-1].endswith("nor does its run folder hold one (tapered/, or the recorded model)")
    )


def test_eval_and_fold_of_a_trainer_checkpoint_find_the_runs_tokenizer(ws, baseline_run, tmp_path):
    checkpoint = next(baseline_run.glob("checkpoint-*"))
    assert not (checkpoint / "tokenizer.json").exists()
    code, stdout, stderr = run_main(
        ["eval", "--model_name_or_path", str(checkpoint), "--dataset_name", str(ws / "corpus.txt"),
         "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--out_of_corpus_blocks", "0",
         "--scan_windows", "0"]
    )  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout.strip().splitlines()[0])
    report = json.loads((baseline_run / "report.json").read_text())
    assert result["kind"] == "tapered" and result["loss"] == pytest.approx(report["heldout"]["tapered"]["loss"], 1e-5)
    export = tmp_path / "export"
    code, _, stderr = run_main(
        ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(export), "--scan_windows", "0"]
    )
    assert code == 0, stderr
    assert load_tokenizer(resolve_model(str(export)))("ab")["input_ids"] == [97, 98]


def test_a_checkpoint_is_evaluated_with_the_recorded_model_s_tokenizer_where_tapered_cannot_lend_it(
    ws, baseline_run, tmp_path, caplog
):
    """eval of a complete checkpoint-N whose run's tapered/ lacks its tapernorm_config.json was refused as "model
    '.../tapered' is a tapered checkpoint without its tapernorm_config.json ... or pass a complete checkpoint": the
    tapered/ read only for its tokenizer was refused as a model. It is skipped now, and the recorded original model
    lends the tokenizer, as before; the checkpoint scores as the run reported it."""
    run = copy_of(baseline_run, tmp_path)
    (run / "tapered" / "tapernorm_config.json").unlink()
    caplog.set_level(logging.INFO, logger="hf_tapernorm")
    code, stdout, stderr = run_main(
        evaluate(run / "checkpoint-6", "--heldout_percentage", "10", data=ws / "corpus.txt")
    )
    assert code == 0, stderr[-2000:]
    assert f"holds no tokenizer: using its run's, from {ws / 'llama'}" in caplog.text
    result = json.loads(stdout.strip().splitlines()[0])
    report = json.loads((run / "report.json").read_text())
    assert result["kind"] == "tapered" and result["loss"] == pytest.approx(report["heldout"]["tapered"]["loss"], 1e-5)


def test_a_gpt2_folder_without_tokenizer_files_holds_no_tokenizer(tmp_path):
    """A GPT-2 Trainer checkpoint-N holds no tokenizer files, but transformers built one from nothing (one token,
    every text encoded to no token), so fold exported it, push uploaded it and eval called the data "too small"; the
    run's tokenizer was never looked for. A local folder without tokenizer files holds none now (refused, so
    tokenizer_of takes the run's)."""
    from transformers import GPT2LMHeadModel

    from tests.helpers import tiny_gpt2_config

    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelSourceError) as refusal:
        load_tokenizer(resolve_model(str(tmp_path / "gpt2")))
    assert str(refusal.value) == (
        f"cannot load a tokenizer from '{tmp_path / 'gpt2'}': it holds no tokenizer vocabulary (none of "
        "tokenizer.json, tokenizer.model, tekken.json, vocab.json, ...)"
    )


def test_a_checkpoint_copied_out_of_its_run_takes_the_tokenizer_of_the_model_it_recorded(ws, baseline_run, tmp_path):
    """A complete tapered checkpoint copied out of its run folder (renamed, or moved) was refused "cannot load a
    tokenizer", and fold exported it without one, though its own tapernorm_run.json records the original model and
    its files' digests, and that model is there. Its recorded model lends the tokenizer, as a run's does."""
    lonely = Path(shutil.copytree(next(baseline_run.glob("checkpoint-*")), tmp_path / "lonely-ckpt"))
    code, stdout, stderr = run_main(evaluate(lonely, "--heldout_percentage", "10", data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    report = json.loads((baseline_run / "report.json").read_text())
    assert json.loads(stdout.strip().splitlines()[0])["loss"] == pytest.approx(
        report["heldout"]["tapered"]["loss"], 1e-5
    )
    code, _, stderr = run_main(["fold", "--checkpoint", str(lonely), "--output_dir", str(tmp_path / "export"),
                                "--scan_windows", "0"])  # fmt: skip
    assert code == 0, stderr[-2000:]
    assert load_tokenizer(resolve_model(str(tmp_path / "export")))("ab")["input_ids"] == [97, 98]


def _records_model(checkpoint: Path, model: Path, run: Path | None = None, **contents) -> None:
    """Point the checkpoint's own record (and its run's manifest) at ``model``, recording its files now."""
    from hf_tapernorm.app.fingerprints import fingerprint

    recorded = {"model": str(model), "model_contents": fingerprint(str(model), weights_by_size=True), **contents}
    edit_json(checkpoint / IDENTITY, **recorded)
    if run is not None:
        manifest = json.loads((run / MANIFEST_NAME).read_text())
        manifest["identity"].update(recorded)
        (run / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_recorded_model_given_another_tokenizer_since_lends_none(ws, baseline_run, tmp_path, caplog):
    """A checkpoint without tokenizer files whose record names its model by an absolute path took whatever tokenizer
    that folder held now: a model given another tokenizer since lent it without a word (another loss; fold exported
    it). The recorded model lends its tokenizer only where its tokenizer files are the ones the run recorded; eval
    refuses otherwise, saying why. A record of an older version, without model_contents, still lends it."""
    from tests.helpers import word_tokenizer

    model = Path(shutil.copytree(ws / "llama", tmp_path / "llama"))
    lonely = Path(shutil.copytree(baseline_run / "checkpoint-6", tmp_path / "lonely"))
    _records_model(lonely, model)
    word_tokenizer(adds_bos=False).save_pretrained(model)  # the user's model folder holds another tokenizer now
    caplog.set_level(logging.INFO, logger="hf_tapernorm")
    line = refused(evaluate(lonely, data=ws / "corpus.txt"))
    assert line.endswith("nor does its run folder hold one (tapered/, or the recorded model)")
    assert (
        f"the run recorded its model '{model}', whose tokenizer files are not the ones the run recorded (changed "
        "since): its tokenizer is not used" in caplog.text
    )
    code, _, stderr = run_main(fold(lonely, tmp_path / "export"))
    assert code == 0, stderr[-2000:]
    assert not (tmp_path / "export" / "tokenizer.json").exists()
    edit_json(lonely / IDENTITY, model_contents=None)  # as a run of an older version recorded it
    code, _, stderr = run_main(evaluate(lonely, data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    assert f"holds no tokenizer: using its run's, from {model}" in caplog.text


def test_a_checkpoint_of_another_run_put_into_a_run_folder_reads_its_own_runs_tokenizer(
    ws, baseline_run, tmp_path, caplog
):
    """A checkpoint of run B copied into run A's folder as checkpoint-99 took run A's tapered/ tokenizer, though its
    own tapernorm_run.json records another model: the export held a tokenizer the model never trained with. The
    checkpoint's own record wins: its recorded model lends the tokenizer where it holds the recorded files, and
    where it does not, eval refuses saying the checkpoint belongs to another run."""
    from tests.helpers import word_tokenizer

    run = copy_of(baseline_run, tmp_path)
    other = save_tiny_model(tmp_path / "other", "llama", seed=1)
    word_tokenizer(adds_bos=False).save_pretrained(other)
    stranger = Path(shutil.copytree(run / "checkpoint-6", run / "checkpoint-99"))
    _records_model(stranger, other)
    caplog.set_level(logging.INFO, logger="hf_tapernorm")
    code, _, stderr = run_main(evaluate(stranger, data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    assert f"records another model than its run folder {run}: that run's tokenizer is not used" in caplog.text
    assert f"holds no tokenizer: using its run's, from {other}" in caplog.text
    (other / "tokenizer.json").unlink()
    line = refused(evaluate(stranger, data=ws / "corpus.txt"))
    assert line.endswith(
        f"it is a checkpoint of another run than the folder '{run}' it lies in (its tapernorm_run.json records "
        "another model), and the model it records holds no tokenizer here: copy that run's tokenizer files into it"
    )
    _records_model(run / "checkpoint-6", other, run)  # a run of that same model: its own checkpoint still reads
    code, _, stderr = run_main(evaluate(run / "checkpoint-6", data=ws / "corpus.txt"))  # tapered/'s tokenizer
    assert code == 0, stderr[-2000:]


def test_a_checkpoint_of_another_run_put_into_a_run_folder_is_not_scanned_against_that_runs_model(
    ws, baseline_run, tmp_path, caplog
):
    """A checkpoint of another run copied into a run folder took that folder's tokenizer no longer, but the robustness
    scan still compared it with the folder's baseline or original, a model it never was (fold wrote "no broken
    window ... against the original model" into the export's card and robustness_scan.json, eval recorded that
    reference); fold's card named that run's base model too. Now neither scans it, each saying why in a WARNING with
    its way out, and fold's card names no base model of that run; the run's own checkpoint is scanned as before."""
    from tests.helpers import word_tokenizer

    run = copy_of(baseline_run, tmp_path)
    other = save_tiny_model(tmp_path / "other", "llama", seed=1)
    word_tokenizer(adds_bos=False).save_pretrained(other)
    stranger = Path(shutil.copytree(run / "checkpoint-6", run / "checkpoint-99"))
    _records_model(stranger, other)
    caplog.set_level(logging.WARNING, logger="hf_tapernorm")
    why = (
        f"no robustness scan of {stranger}: it records another model than the run in {run} (a checkpoint of another "
        "run), so that run's baseline or original is not its reference; "
    )
    result = tmp_path / "result.json"
    code, _, stderr = run_main(
        evaluate(stranger, "--scan_windows", "2", "--output_json", str(result), data=ws / "corpus.txt")
    )
    assert code == 0, stderr[-2000:]
    assert why + "pass --scan_reference" in caplog.text
    assert "robustness_scan" not in json.loads(result.read_text())
    caplog.clear()
    code, _, stderr = run_main([*fold(stranger, tmp_path / "export")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert why + "scan the export with hf-tapernorm eval --scan_reference" in caplog.text
    assert not (tmp_path / "export" / "robustness_scan.json").exists()
    card = (tmp_path / "export" / "README.md").read_text()
    assert "Robustness scan" not in card and "base_model:" not in card
    code, _, stderr = run_main([*fold(run / "checkpoint-6", tmp_path / "own")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert json.loads((tmp_path / "own" / "robustness_scan.json").read_text())["reference"] == "baseline"


def test_an_export_or_checkpoint_a_run_did_not_write_is_not_scanned_against_that_runs_model(
    ws, baseline_run, tmp_path, caplog
):
    """A run's folded/ or tapered/ copied into another run's folder (as foldedG/, taperedG/) was scanned against that
    run's baseline without a word (an export has no tapernorm_run.json to tell it by), and fold's card was titled
    after that run's model; so was a checkpoint of the run's own folder whose record names another model. A folder
    the run's manifest lists no file of, or one recording another model, is not the run's: no scan, said why."""
    run = copy_of(baseline_run, tmp_path)
    shutil.copytree(run / "folded", run / "foldedG")
    shutil.copytree(run / "tapered", run / "taperedG")
    caplog.set_level(logging.WARNING, logger="hf_tapernorm")
    result = tmp_path / "result.json"
    argv = evaluate(run / "foldedG", "--scan_windows", "2", "--output_json", str(result), data=ws / "corpus.txt")
    assert run_main(argv)[0] == 0
    assert "robustness_scan" not in json.loads(result.read_text())
    assert (
        f"no robustness scan of {run / 'foldedG'}: the run in {run} did not write it (its manifest lists no file of "
        "foldedG/), so that run's baseline or original is not its reference; pass --scan_reference"
    ) in caplog.text
    code, _, stderr = run_main([*fold(run / "taperedG", tmp_path / "export")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert not (tmp_path / "export" / "robustness_scan.json").exists()
    assert "base_model:" not in (tmp_path / "export" / "README.md").read_text()
    manifest = json.loads((run / MANIFEST_NAME).read_text())
    listed = manifest["files"]
    manifest["files"] = [entry for entry in listed if not entry.startswith("checkpoint-6/")]
    (run / MANIFEST_NAME).write_text(json.dumps(manifest))  # as a kill between its save and the run's record leaves it
    code, _, stderr = run_main([*fold(run / "checkpoint-6", tmp_path / "unrecorded")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert json.loads((tmp_path / "unrecorded" / "robustness_scan.json").read_text())["reference"] == "baseline"
    other = save_tiny_model(tmp_path / "other", "llama", seed=1)
    _records_model(run / "checkpoint-6", other)  # a checkpoint of the run's, but recording another model
    caplog.clear()
    code, _, stderr = run_main([*fold(run / "checkpoint-6", tmp_path / "c6")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert (
        f"no robustness scan of {run / 'checkpoint-6'}: it records another model than the run in {run} (a checkpoint "
        "of another run), so that run's baseline or original is not its reference; scan the export with "
        "hf-tapernorm eval --scan_reference"
    ) in caplog.text


def test_a_model_safetensors_added_beside_a_sharded_originals_shards_is_another_model(tmp_path):
    """A sharded original given a model.safetensors beside its shards was still the scan's reference, though
    transformers loads that file first: the scan compared with other weights without a word."""
    from hf_tapernorm.app.fingerprints import fingerprint, holds_recorded_weights

    original = tmp_path / "sharded"
    original.mkdir()
    (original / "config.json").write_text("{}")
    (original / "model.safetensors.index.json").write_text("{}")
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (original / shard).write_bytes(shard.encode())
    recorded = fingerprint(str(original), weights_by_size=True)
    assert holds_recorded_weights(str(original), recorded)
    (original / "model.safetensors").write_bytes(b"other weights, loaded first")
    assert not holds_recorded_weights(str(original), recorded)


def _scanned_against(argv: list[str], result: Path) -> str | None:
    """Run eval ``argv`` (which writes ``result``): the model its robustness scan compared with, None without a scan."""
    code, _, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    return json.loads(result.read_text()).get("robustness_scan", {}).get("reference")


def test_a_runs_original_given_another_model_since_or_gone_is_not_its_scans_reference(
    ws, baseline_run, tmp_path, caplog
):
    """A run without a baseline is scanned against its original; that folder given another model since (a fine-tune
    saved over it, another model copied there) was scanned against as the original without a word, though the run
    recorded its files; and an original moved away was told as a run folder "that names no baseline or original".
    The original is the reference only while it holds the weights and config the run recorded (a notes file, a
    re-saved tokenizer setting or a .git/ folder beside them change no model); otherwise a WARNING says which."""
    run = copy_of(baseline_run, tmp_path)
    original = Path(shutil.copytree(ws / "llama", tmp_path / "original"))
    report = json.loads((run / "report.json").read_text())
    report["export"]["baseline_model"] = None  # as a run without --baseline
    report["model"]["source"] = str(original)
    (run / "report.json").write_text(json.dumps(report))
    caplog.set_level(logging.WARNING, logger="hf_tapernorm")
    result = tmp_path / "result.json"
    argv = evaluate(run / "folded", "--scan_windows", "2", "--output_json", str(result), data=ws / "corpus.txt")
    assert _scanned_against(argv, result) == str(original)
    (original / "NOTES.md").write_text("my notes\n")  # beside the same weights: the same model
    edit_json(original / "tokenizer_config.json", local_files_only=True)  # as a re-save through transformers adds
    (original / ".git").mkdir()  # a cloned repository's bookkeeping
    (original / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert _scanned_against(argv, result) == str(original)
    (original / "pytorch_model.bin").write_bytes(b"a copy transformers does not load beside safetensors")
    (original / "consolidated.safetensors").write_bytes(b"another layout's copy, not loaded either")
    assert _scanned_against(argv, result) == str(original)
    assert "the original model" not in caplog.text
    save_tiny_model(original, "llama", seed=1)  # other weights saved over it
    assert _scanned_against(argv, result) is None
    assert (
        f"the original model that the run in {run} recorded holds another model now ({original}: its weights or "
        "config.json changed since the run recorded them; a re-save by another transformers version counts too; "
        "--scan_reference compares with it anyway): the robustness scan has no model of the run to compare with"
    ) in caplog.text
    assert "is not in a run folder" not in caplog.text  # said once, why
    shutil.rmtree(original)
    shutil.copytree(ws / "llama", original)
    assert _scanned_against(argv, result) == str(original)  # the same model again
    edit_json(original / "config.json", hidden_act="relu")  # the same weights computing another function
    caplog.clear()
    assert _scanned_against(argv, result) is None
    assert "holds another model now" in caplog.text
    shutil.rmtree(original)
    caplog.clear()
    assert run_main(argv)[0] == 0
    assert (
        f"the original model that the run in {run} recorded is not there ({original}): the robustness scan has no "
        "model of the run to compare with"
    ) in caplog.text


def test_an_export_folded_from_a_runs_checkpoint_generates_with_a_kv_cache(run, tmp_path):
    """The Trainer sets use_cache=False in the config.json of the checkpoints it trains; load_tapered built the model
    from that config, so its generation config, and that of every export folded from it (fold's, or
    export_folded(fold_model(load_tapered(...)))), said use_cache false: generate() ran without a KV cache,
    recomputing the whole sequence at each token, without a word. The checkpoint's generation_config.json is read,
    and use_cache is the model family's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tapernorm import load_tapered

    assert json.loads((run / "tapered" / "config.json").read_text())["use_cache"] is False  # as the Trainer left it
    tapered_model = load_tapered(run / "tapered")
    assert tapered_model.config.use_cache is True and tapered_model.generation_config.use_cache is True
    assert run_main(fold(run / "tapered", tmp_path / "export"))[0] == 0
    saved = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert saved["use_cache"] is True
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    out = export.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values is not None


def test_a_runs_baseline_given_another_model_since_is_not_its_scans_reference(ws, baseline_run, tmp_path, caplog):
    """A run's baseline (its own baseline/model, or the one --baseline_from named) given other weights since was
    still the scan's reference, without a word: the scan compared with a model the run never measured. The run
    records the baseline's weights and config.json; a baseline that no longer holds them is not the reference (the
    original is, where it still holds the run's model), said in a WARNING with the way out."""
    from hf_tapernorm.app.fingerprints import weights_and_config

    run = copy_of(baseline_run, tmp_path)
    baseline = run / "baseline" / "model"
    caplog.set_level(logging.WARNING, logger="hf_tapernorm")
    result = tmp_path / "result.json"
    argv = evaluate(run / "folded", "--scan_windows", "2", "--output_json", str(result), data=ws / "corpus.txt")
    assert _scanned_against(argv, result) == str(baseline)
    (baseline / "NOTES.md").write_text("my notes\n")  # beside the same weights: the same model
    edit_json(baseline / "tokenizer_config.json", local_files_only=True)
    assert _scanned_against(argv, result) == str(baseline)
    assert "the baseline" not in caplog.text
    save_tiny_model(baseline, "llama", seed=1)  # other weights saved over it, as a fine-tune in place would
    assert _scanned_against(argv, result) == str(ws / "llama")
    assert (
        f"the baseline that the run in {run} recorded holds another model now ({baseline}: its weights or config.json "
        "changed since the run recorded them; a re-save by another transformers version counts too; --scan_reference "
        f"compares with it anyway): the robustness scan compares with the original model instead ({ws / 'llama'})"
    ) in caplog.text
    original = Path(shutil.copytree(ws / "llama", tmp_path / "original"))  # the same model, then another config
    recorded_model = json.loads((run / "report.json").read_text())["model"]
    edit_json(run / "report.json", model={**recorded_model, "source": str(original)})
    edit_json(original / "config.json", rms_norm_eps=1e-3)
    caplog.clear()
    assert _scanned_against(argv, result) is None
    assert (
        f"the robustness scan compares with no model of the run (its original, {original}, holds another model now: "
        "its weights or config.json changed since the run recorded them;"
    ) in caplog.text
    named = finished_run(taper(ws, tmp_path / "named", "--baseline_from", str(baseline_run)))
    recorded = json.loads((named / "report.json").read_text())["export"]
    assert recorded["baseline_model"] == str(baseline_run / "baseline" / "model")
    assert recorded["baseline_contents"] == weights_and_config(str(baseline_run / "baseline" / "model"))
    assert set(recorded["baseline_contents"]) == {"config.json", "model.safetensors"}


@pytest.mark.parametrize("settings", [{"special_tokens_map.json": '{"eos_token": "<|endoftext|>"}'},
                                      {"tokenizer_config.json": '{"eos_token": "<|endoftext|>"}'}])  # fmt: skip
def test_a_gpt2_folder_with_tokenizer_settings_but_no_vocabulary_holds_no_tokenizer(tmp_path, settings):
    """A GPT-2 checkpoint holding only special_tokens_map.json or only tokenizer_config.json counted as holding a
    tokenizer, and transformers built one from nothing (one token, every text encoded to none): eval called the
    corpus too small, fold exported it. A folder holds a tokenizer only with a vocabulary file; settings alone fall
    back to the run's, as a folder without tokenizer files does."""
    from transformers import GPT2LMHeadModel

    from tests.helpers import tiny_gpt2_config

    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    for name, text in settings.items():
        (tmp_path / "gpt2" / name).write_text(text)
    with pytest.raises(ModelSourceError) as refusal:
        load_tokenizer(resolve_model(str(tmp_path / "gpt2")))
    assert str(refusal.value) == (
        f"cannot load a tokenizer from '{tmp_path / 'gpt2'}': it holds no tokenizer vocabulary (none of "
        "tokenizer.json, tokenizer.model, tekken.json, vocab.json, ...)"
    )


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.json+merges.txt"])
def test_a_gpt2_folder_with_a_vocabulary_alone_loads_its_tokenizer(tmp_path, files):
    """The vocabulary check refuses no real tokenizer: a GPT-2 folder with tokenizer.json only, or vocab.json and
    merges.txt only, loads its own."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2LMHeadModel

    from tests.helpers import tiny_gpt2_config

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(folder)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_documents(20), vocab_size=300, special_tokens=["<|endoftext|>"])
    if files == "tokenizer.json":
        bpe.save(str(folder / "tokenizer.json"))
    else:
        bpe.save_model(str(folder))
    tokenizer = load_tokenizer(resolve_model(str(folder)))
    assert len(tokenizer) == 300 and tokenizer("the quick fox")["input_ids"] == bpe.encode("the quick fox").ids


def test_loading_a_tapered_checkpoints_tokenizer_gives_no_model_type_warning(run):
    """Every command that read a tapered checkpoint's tokenizer (fold, eval) printed transformers' WARNING "You are
    using a model of type `hf_tapernorm_tapered_llama` to instantiate a model of type ``": AutoTokenizer's fallback
    read the checkpoint's config (a model type transformers does not know, on purpose). The config is now handed to
    it read, and the tokenizer is the one saved."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        tokenizer = load_tokenizer(resolve_model(str(run / "tapered")))
    finally:
        transformers_logger.removeHandler(handler)
    assert tokenizer("ab")["input_ids"] == [97, 98]
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


# ============================================================================= checkpoints fold and eval refuse
def test_a_model_lacking_its_weights_is_refused_naming_its_option_before_anything_loads(ws, run, tmp_path, monkeypatch):
    """A tapered checkpoint without its .safetensors weights was refused as "tapered checkpoint '...' has no
    .safetensors weights" only as its weights loaded, and eval of a plain model without its weights said
    transformers' "cannot load model '...': OSError: Error no file named model.safetensors" once its tokenizer had
    loaded; neither named the option. Both are now refused from the folder's files, before the tokenizer or the
    model loads, naming --checkpoint or --model_name_or_path as typed."""
    import hf_tapernorm.app.run_tokenizer as run_tokenizer
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(run_tokenizer, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was loaded"))
    tapered = copy_of(run, tmp_path) / "tapered"
    (tapered / "model.safetensors").unlink()
    what = (
        "' is a tapered checkpoint that has no .safetensors weights: restore them from its run, or pass a complete "
        "checkpoint (a run's tapered/ or a checkpoint-N)"
    )
    line = refused(fold(tapered, tmp_path / "export"))
    assert line == f"hf-tapernorm fold: error: --checkpoint '{tapered}{what}"
    assert not (tmp_path / "export").exists()
    line = refused(evaluate(tapered, data=ws / "corpus.txt"))
    assert line == f"hf-tapernorm eval: error: --model_name_or_path '{tapered}{what}"
    plain = shutil.copytree(ws / "llama", tmp_path / "llama")
    (plain / "model.safetensors").unlink()
    line = refused(evaluate(plain, data=ws / "corpus.txt"))
    assert line == (
        f"hf-tapernorm eval: error: --model_name_or_path '{plain}' has no weights: none of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json is in it; copy the model's "
        "weights into it, or pass the folder of a complete saved model"
    )


def test_a_checkpoint_without_its_weights_still_lends_its_tokenizer(run, tmp_path):
    """Only the tokenizer of a run's tapered/ is read where a checkpoint-N lacks one: a tapered/ without its weights
    still lends it (resolve_model(weights=False)), while a load of it is refused."""
    tapered = copy_of(run, tmp_path) / "tapered"
    (tapered / "model.safetensors").unlink()
    assert load_tokenizer(resolve_model(str(tapered), weights=False))("ab")["input_ids"] == [97, 98]
    with pytest.raises(ModelSourceError, match="has no .safetensors weights"):
        resolve_model(str(tapered))


@pytest.mark.parametrize("option", ["--checkpoint", "--model_name_or_path"])
def test_a_folder_without_config_json_is_told_to_pass_a_gguf_file_only_where_the_option_reads_one(ws, tmp_path, option):
    """fold --checkpoint of a folder without config.json was told "for a GGUF file pass its path or --gguf_file",
    an option fold does not have (nor --baseline_from, --scan_reference, push's --export_dir). Only an option that
    reads a GGUF file says so."""
    plain = shutil.copytree(ws / "llama", tmp_path / "llama")
    (plain / "config.json").unlink()
    gguf = " (for a GGUF file pass its path or --gguf_file)" if option == "--model_name_or_path" else ""
    with pytest.raises(ModelSourceError) as refusal:
        resolve_model(str(plain), option=option)
    assert str(refusal.value) == (
        f"{option} '{plain}' is a folder without config.json: not a saved Hugging Face model{gguf}"
    )


def test_peft_adapters_beside_a_whole_model_are_refused(ws, tmp_path):
    """A model merged and saved into the folder its adapters were in (adapter_config.json and adapter weights beside
    config.json and model.safetensors) was evaluated without a word: loading applied the adapters on top of the merged
    weights again, another model than the one asked for."""
    model = shutil.copytree(ws / "llama", tmp_path / "merged")
    (model / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x"}))
    with pytest.raises(ModelSourceError) as refusal:
        resolve_model(str(model), option="--model_name_or_path")
    assert str(refusal.value) == (
        f"--model_name_or_path '{model}' holds PEFT adapters (adapter_config.json) beside its weights "
        "(model.safetensors), which loading applies on top of them: move the adapter files out of the folder to read "
        "the model alone, or pass the base model and merge the adapters into it first"
    )


def _sharded(folder: Path, shards: list[str], **extra) -> None:
    """Replace ``folder``'s model.safetensors by an index naming ``shards`` (the first one the weights renamed)."""
    (folder / "model.safetensors").rename(folder / shards[0])
    weight_map = {f"t{i}": shard for i, shard in enumerate(shards)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map, **extra}))


def test_a_sharded_tapered_checkpoint_lacking_a_shard_is_refused_before_it_loads(run, tmp_path):
    """A tapered checkpoint hand-sharded with an index, one shard missing: eval said its tensors did not match the
    patched model, and fold that it was "saved at gate 1", neither true. The index's shards are checked first, as a
    plain model's are; a stale index beside a whole model.safetensors (which the loader reads) is no refusal."""
    tapered = copy_of(run, tmp_path) / "tapered"
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _sharded(tapered, shards)
    with pytest.raises(ModelSourceError) as refusal:
        resolve_model(str(tapered), option="--checkpoint")
    assert str(refusal.value) == (
        f"--checkpoint '{tapered}' lacks 1 of the 2 shard file(s) its model.safetensors.index.json names "
        "(model-00002-of-00002.safetensors): copy them into it, or pass the folder of a complete saved model"
    )
    (tapered / shards[0]).rename(tapered / "model.safetensors")
    assert resolve_model(str(tapered), option="--checkpoint").kind == "tapered"


def test_a_sharded_model_whose_index_has_no_metadata_is_refused_as_damaged(ws, tmp_path):
    """A hand-written index with a weight_map but no metadata passed the shard check, then failed at load with
    "cannot load model: KeyError: 'metadata'", naming no option: transformers reads both."""
    model = shutil.copytree(ws / "llama", tmp_path / "sharded")
    _sharded(model, ["model-00001-of-00001.safetensors"])
    with pytest.raises(ModelSourceError) as refusal:
        resolve_model(str(model), option="--model_name_or_path")
    assert str(refusal.value) == (
        f"--model_name_or_path '{model}' has a damaged model.safetensors.index.json (it holds no metadata mapping): "
        "restore it, or pass the folder of a complete saved model"
    )
    _sharded_index = json.loads((model / "model.safetensors.index.json").read_text())
    (model / "model.safetensors.index.json").write_text(json.dumps({**_sharded_index, "metadata": {}}))
    assert resolve_model(str(model), option="--model_name_or_path").kind == "folder"


def test_fold_refuses_a_checkpoint_above_gate_zero_before_loading_it(tmp_path, monkeypatch):
    """A checkpoint saved mid-taper was refused only once the model had loaded and been patched (twice); its gate is
    read from its files (the TaperNorm gate tensors; kept norms hold 1) before the weights load."""
    import hf_tapernorm.cli.commands as commands
    from hf_tapernorm import save_tapered
    from hf_tapernorm.layers import set_gate

    model = tapered("llama", keep_norms=["model.layers.0.*"])
    set_gate(model, 0.5)
    folder = save_tapered(model, tmp_path / "half")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("loaded before the gate was read"))
    line = refused(fold(folder, tmp_path / "export"))
    assert line == (
        f"hf-tapernorm fold: error: '{folder}' was saved at gate 0.5: only a model at g = 0 folds; finish its taper "
        "(resume the run) and fold the checkpoint written at g = 0"
    )
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    ("kind", "scope", "why"),
    [
        (
            "llama",
            "all",
            "its final norm feeds no tied lm_head (tie_word_embeddings is false, or a projection stands between them)",
        ),
        (
            "gpt2",
            "internal",
            "its final norm transformer.ln_f is kept (tapernorm_config.json's scope or keep_norms), so the tied head "
            "is unchanged",
        ),
    ],
)
def test_fold_refuses_tied_head_scale_where_it_changes_nothing_before_loading(kind, scope, why, tmp_path, monkeypatch):
    """--tied_head scale on an untied head, or with the final norm kept, wrote the default export
    (byte for byte) without a word; it is refused from the checkpoint's config and recipe before the weights load."""
    import hf_tapernorm.cli.commands as commands
    from hf_tapernorm import save_tapered

    folder = save_tapered(tapered(kind, scope), tmp_path / "tapered")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("loaded before --tied_head was checked"))
    line = refused(fold(folder, tmp_path / "export", "--tied_head", "scale"))
    assert line == (
        f"hf-tapernorm fold: error: --tied_head scale has no effect on '{folder}': {why}; the export would be the "
        "default one, so leave --tied_head out"
    )
    assert not (tmp_path / "export").exists()


def test_fold_refuses_an_unused_tied_head_after_loading_where_the_config_cannot_tell(tmp_path, monkeypatch):
    """Where no weightless copy can be built from the checkpoint's files, the loaded model answers: refused before
    anything is written."""
    from hf_tapernorm import save_tapered
    from hf_tapernorm.app import tapered_checks

    folder = save_tapered(tapered("llama", "all"), tmp_path / "tapered")
    monkeypatch.setattr(tapered_checks, "_weightless", lambda checkpoint: None)
    refused(fold(folder, tmp_path / "export", "--tied_head", "scale"), "--tied_head scale has no effect on")
    assert not (tmp_path / "export").exists()


def test_fold_with_tied_head_scale_keeps_the_tie_where_the_final_norm_meets_it(tmp_path):
    """The choice still applies where it matters: a tapered final norm before a tied head."""
    from hf_tapernorm import save_tapered

    folder = save_tapered(tapered("gpt2", "all", tie_word_embeddings=True), tmp_path / "tapered")
    code, _, stderr = run_main(fold(folder, tmp_path / "export", "--tied_head", "scale"))
    assert code == 0, stderr
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["tied_head"] == "scale" and config["tie_word_embeddings"] is True


def test_eval_and_fold_refuse_a_checkpoint_whose_sink_is_not_the_one_its_run_trained_with(ws, run, tmp_path):
    """A tapered checkpoint whose tapernorm_config.json had its sink_token_ids edited was evaluated and folded (the
    weights cannot tell: the sink is a position, not a tensor), and the export stored the wrong sink. The run's
    record tells the sink it trained with: its report.json for tapered/, a Trainer checkpoint's tapernorm_run.json."""
    folder = copy_of(run, tmp_path)
    trained = json.loads((folder / "report.json").read_text())["taper"]["sink_token_ids"]
    assert trained and trained != [5]
    checkpoint = next(folder.glob("checkpoint-*"))
    for tapered_folder, record in ((folder / "tapered", folder / "report.json"), (checkpoint, checkpoint / IDENTITY)):
        edit_json(tapered_folder / "tapernorm_config.json", sink_token_ids=[5])
        expected = f"error: {_sink_records_disagree(tapered_folder, [5], record, trained)}"
        assert refused(fold(tapered_folder, tmp_path / "export")) == f"hf-tapernorm fold: {expected}"
        assert refused(evaluate(tapered_folder, data=ws / "corpus.txt")) == f"hf-tapernorm eval: {expected}"
        assert not (tmp_path / "export").exists()


def _sink_records_disagree(checkpoint: Path, ids: list, record: Path, recorded: list) -> str:
    return (
        f"tapered checkpoint '{checkpoint}': its tapernorm_config.json names sink_token_ids {ids}, but its run's "
        f"record {record} names {recorded}: the two records of the sink it was trained with disagree, and its weights "
        "cannot tell which is right; one of the files was edited since, or the checkpoint is not that run's: restore "
        "the edited one as the run wrote it"
    )


def test_a_report_whose_sink_was_edited_is_refused_without_asking_to_edit_the_checkpoint(run, tmp_path):
    """report.json's taper.sink_token_ids edited to [5]: fold of tapered/ was refused with "restore sink_token_ids [5]
    in tapernorm_config.json", blaming the untouched checkpoint; following that advice folded an export with another
    sink than the one its weights were trained with. The refusal now says the two records disagree, and asks to
    restore whichever was edited, naming neither as the one to change."""
    folder = copy_of(run, tmp_path)
    trained = json.loads((folder / "tapered" / "tapernorm_config.json").read_text())["sink_token_ids"]
    report = json.loads((folder / "report.json").read_text())
    edit_json(folder / "report.json", taper={**report["taper"], "sink_token_ids": [5]})
    expected = _sink_records_disagree(folder / "tapered", trained, folder / "report.json", [5])
    assert refused(fold(folder / "tapered", tmp_path / "export")) == f"hf-tapernorm fold: error: {expected}"
    assert not (tmp_path / "export").exists()


# ============================================================================= where fold writes
def test_fold_to_an_unwritable_destination_is_refused_before_loading(baseline_run, tmp_path, monkeypatch):
    import hf_tapernorm.cli.commands as commands

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("loaded before the destination check"))
    fold = ["fold", "--checkpoint", str(baseline_run / "tapered"), "--output_dir", str(locked / "export")]
    refused(fold, f"'{locked}' is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_fold_into_a_read_only_folder(baseline_run, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        refused(["fold", "--checkpoint", str(baseline_run / "tapered"), "--output_dir", str(locked / "x")], "writable")
    finally:
        locked.chmod(0o755)


def test_fold_overwrite_of_the_runs_own_export_replaces_it_with_the_same_model(run, tmp_path):
    folder = copy_of(run, tmp_path)
    before = (folder / "folded" / "model.safetensors").read_bytes()
    assert run_main(fold(folder / "tapered", folder / "folded", "--overwrite"))[0] == 0
    assert (folder / "folded" / "model.safetensors").read_bytes() == before


# ============================================================================= the disk an export needs
@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("gpt2", {})])
def test_what_the_export_check_counts_is_what_the_export_writes(kind, overrides, tmp_path):
    """export_writes against the weights file of a real export: never more, and the same bytes up to the vectors
    the tiny models' matrices outweigh; the lm_head a tied Llama's kept RMS final norm unties is counted."""
    from hf_tapernorm.app.preflight import export_writes

    model = tapered(kind, **overrides)
    writes = export_writes(model, "untie")
    folded = fold_model(model)
    export_folded(folded, tmp_path / "export")
    written = (tmp_path / "export" / "model.safetensors").stat().st_size
    assert 0.85 * written <= sum(writes.values()) <= written, (writes, written)
    assert ("the lm_head the fold unties" in writes) == (model.config.tie_word_embeddings and kind == "llama")
    assert not folded.config.tie_word_embeddings or kind == "gpt2"


def test_fold_onto_a_disk_too_small_for_its_export_is_refused_before_loading(run, tmp_path, monkeypatch):
    """It loaded, folded and checked the model, then died writing the export: SafetensorError "No space left on
    device" and a traceback (taper refused the same disk at once)."""
    import hf_tapernorm.app.preflight as preflight
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    written = (run / "folded" / "model.safetensors").stat().st_size
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=written // 2))
    out = tmp_path / "sub" / "export"
    line = refused(fold(run / "tapered", out), f"hf-tapernorm fold: error: --output_dir {out}: its disk has ")
    assert "and this fold writes at least" in line and "(the folded export: its weight matrices " in line, line
    assert line.endswith("; free space or choose an --output_dir on another disk"), line
    assert not (tmp_path / "sub").exists()


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        SafetensorError("Error while serializing: I/O error: File too large (os error 27)"),  # ulimit -f, FAT32
    ],
)
def test_a_disk_that_fills_up_while_fold_writes_is_one_line(run, tmp_path, monkeypatch, error):
    import hf_tapernorm.cli.commands as commands

    def full(folded, tokenizer, folder, facts=None):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"half")
        raise error

    monkeypatch.setattr(commands, "save_export", full)
    out = tmp_path / "export"
    line = refused(fold(run / "tapered", out), f"hf-tapernorm fold: error: --output_dir {out}: its disk could not ")
    assert str(error).split("I/O error: ")[-1] in line and line.endswith("another disk"), line
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # the partial folder is gone


# ============================================================================= the scan's reference
def _scan(run: Path, out: Path) -> dict:
    code, _, stderr = run_main(["fold", "--checkpoint", str(run / "tapered"), "--output_dir", str(out),
                                "--scan_windows", "2"])  # fmt: skip
    assert code == 0, stderr[-2000:]
    return json.loads((out / "robustness_scan.json").read_text())


def test_the_scan_finds_the_runs_baseline_from_any_working_folder(ws, baseline_run, tmp_path, monkeypatch, caplog):
    """report.json recorded the baseline as typed ("runs/bl/baseline/model", relative to the taper command's
    working folder): fold and eval elsewhere read another model at that path and called it the baseline, or
    silently compared with the original."""
    here, other = tmp_path / "here", tmp_path / "other"
    copy_of(baseline_run, here / "runs", "bl")
    save_tiny_model(other / "runs" / "bl" / "baseline" / "model", "llama", seed=1)  # where the typed path leads
    monkeypatch.chdir(here)
    run = here / "runs" / "new"
    finished_run([*taper(ws, "runs/new", "--baseline_from", "runs/bl"), "--scan_windows", "2"])
    report = json.loads((run / "report.json").read_text())
    assert report["export"]["baseline_model"] == str((here / "runs" / "bl" / "baseline" / "model").resolve())
    expected = _scan(run, tmp_path / "f_here")
    assert expected["reference"] == "baseline"
    monkeypatch.chdir(other)
    assert _scan(run, tmp_path / "f_other") == expected
    code, stdout, stderr = run_main(evaluate(run / "folded", "--scan_windows", "2", data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    assert json.loads(stdout.splitlines()[0])["robustness_scan"]["reference"] == report["export"]["baseline_model"]
    # a report of an earlier version: the paths as typed, and no working folder
    report.pop("working_folder")
    (run / "report.json").write_text(json.dumps({**report, "export": {**report["export"],
        "baseline_model": "runs/bl/baseline/model", "tapered_checkpoint": "runs/new/tapered"}}))  # fmt: skip
    assert _scan(run, tmp_path / "f_old") == expected
    # a baseline that is gone: said, and the scan compares with the original
    edit_json(run / "report.json", export={**report["export"], "baseline_model": str(tmp_path / "gone")})
    with caplog.at_level(logging.WARNING):
        assert _scan(run, tmp_path / "f_gone")["reference"] == "original"
    assert f"recorded is not there ({tmp_path / 'gone'}): the robustness scan compares with the original" in caplog.text


def test_a_copied_run_is_scanned_against_its_own_baseline(baseline_run, tmp_path):
    """A copy of a --baseline run read the baseline at the absolute path the original recorded, not its own: its
    scan compared with whatever that path held. It reads its own baseline/model (here the recorded path holds another
    model), and only while that holds the baseline the run recorded."""
    copy = copy_of(baseline_run, tmp_path, "blcopy")
    decoy = save_tiny_model(tmp_path / "decoy", "llama", seed=3)
    edit_json(copy / "report.json", export={**json.loads((copy / "report.json").read_text())["export"],
                                            "baseline_model": str(decoy)})  # fmt: skip
    own = _scan(copy, tmp_path / "f_own")
    recorded = _scan(baseline_run, tmp_path / "f_recorded")
    assert own["reference"] == recorded["reference"] == "baseline"
    assert [row["reference_loss"] for row in own["rows"]] == [row["reference_loss"] for row in recorded["rows"]]
    save_tiny_model(copy / "baseline" / "model", "llama", seed=3)  # the copy's own baseline, now another model
    assert _scan(copy, tmp_path / "f_after")["reference"] == "original"  # neither it nor the decoy


def test_fold_into_the_working_folder_given_as_a_dot_is_one_line(run, tmp_path, monkeypatch):
    """``fold --output_dir .`` ended in a StopIteration traceback (``Path('.')`` has no parents to write beside)."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    line = refused(fold(run / "tapered", "."), "hf-tapernorm fold: error: --output_dir '.' is the working folder: ")
    assert line.endswith("name a folder of its own (--output_dir ./export)") and os.listdir(tmp_path) == ["here"]
    assert os.listdir(here) == []


# ============================================================================= the data a command reads
def test_eval_refuses_a_missing_data_path_before_the_model_loads(ws, run, monkeypatch):
    """eval found a missing --dataset_name, a file as --data_cache_dir (blamed on the dataset: FileExistsError) and a
    missing --out_of_corpus_dataset only once the model had loaded (the last after the whole held-out evaluation);
    taper refused the same paths before its weights loaded."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    missing, corpus, ooc = ws / "missing.txt", ws / "corpus.txt", ws / "missing_ooc.txt"
    line = refused(evaluate(run / "folded", data=missing))
    assert line == f"hf-tapernorm eval: error: --dataset_name '{missing}' not found: no such file or folder"
    line = refused(evaluate(run / "folded", "--data_cache_dir", str(corpus)))
    assert line == f"hf-tapernorm eval: error: --data_cache_dir '{corpus}' is a file"
    line = refused(evaluate(run / "folded", "--out_of_corpus_dataset", str(ooc), "--out_of_corpus_blocks", "2"))
    assert line == f"hf-tapernorm eval: error: --out_of_corpus_dataset '{ooc}' not found: no such file or folder"
    assert not ooc.exists() and corpus.is_file()


def test_eval_refuses_a_data_path_the_loader_cannot_read_before_the_model_loads(ws, tmp_path, monkeypatch):
    """An empty folder, a folder of other files, a file of an unsupported suffix and a folder mixing file types passed
    the early check (it asked only whether the path exists) and were refused once the model had loaded, as
    --out_of_corpus_dataset only after the whole held-out evaluation. The check now asks the loader's own rule."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "bindir").mkdir()
    (tmp_path / "bindir" / "blob.dat").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("some text\n")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "more text"}\n')
    weird = tmp_path / "corpus.weird"
    weird.write_text((ws / "corpus.txt").read_text())
    before = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    types = ".csv/.json/.jsonl/.md/.parquet/.text/.txt"
    supported = ".csv, .json, .jsonl, .md, .parquet, .text, .txt (or a folder of such files, or a Hub dataset name)"
    for option, extra in [("--dataset_name", []), ("--out_of_corpus_dataset", ["--out_of_corpus_blocks", "2"])]:
        for path, reason in [
            (tmp_path / "emptydir", f" is a folder that holds no {types} files"),
            (tmp_path / "bindir", f" is a folder that holds no {types} files"),
            (weird, f": unsupported file type '.weird'; supported: {supported}"),
            (tmp_path / "mixed", " is a folder that mixes file types (json, text); use one type"),
        ]:
            argv = evaluate(ws / "llama", *extra, option, str(path), data=ws / "corpus.txt")
            assert refused(argv) == f"hf-tapernorm eval: error: {option} '{path}'{reason}"
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")} == before


def test_eval_records_the_split_and_the_text_column_it_read(ws, tmp_path):
    """`eval --dataset_split test --output_json r.json` and `--dataset_split train` on one folder gave results that
    differed only in their numbers: nothing said which split was read. The result (printed and written) now records
    the data facts the taper report records: the text column, the configuration, the split, how text was sampled,
    the dataset's absolute path and the cache."""
    folder = tmp_path / "pair"
    folder.mkdir()
    for split, count in (("train", 60), ("test", 40)):
        docs = [f"{split} {line}" for line in (ws / "corpus.txt").read_text().split("\n\n")[:count]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"body": doc}) + "\n" for doc in docs))
    results = {}
    for split in ("test", "train[:50%]"):
        result = tmp_path / f"{split[:4]}.json"
        argv = evaluate(ws / "llama", "--dataset_split", split, "--output_json", str(result), data=folder)
        code, stdout, stderr = run_main([*argv, "--heldout_percentage", "20", "--data_cache_dir", str(tmp_path / "c")])
        assert code == 0, stderr[-2000:]
        results[split] = json.loads(result.read_text())
        assert json.loads(stdout.strip().splitlines()[0]) == {
            k: v for k, v in results[split].items() if k != "written_by"
        }
    for split, recorded in results.items():
        assert {key: recorded[key] for key in ("dataset", "text_column", "config", "split", "dataset_path")} == {
            "dataset": str(folder),
            "text_column": "body",
            "config": None,
            "split": split,
            "dataset_path": str(folder.resolve()),
        }
        assert recorded["cache_dir"] == str(tmp_path / "c") and recorded["sample_by"] == "paragraph"


def test_eval_of_a_post_ln_opt_evaluates_it_without_a_folding_refusal(ws, tmp_path):
    """eval of an original post-LN OPT (do_layer_norm_before=False) evaluated it in full, then stopped with "not
    supported" from the readout check, which asked the architecture table for a final norm to fold. Evaluating a
    base model folds nothing (taper is the command that refuses it): the result is written, its readout not affine,
    with no additivity error (no final norm whose readout could be measured)."""
    from tests.conftest import build, char_tokenizer, tiny_family_config

    model = tmp_path / "opt_post_ln"
    build(tiny_family_config("opt", do_layer_norm_before=False, max_position_embeddings=64)).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    code, stdout, stderr = run_main(evaluate(model, data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    result = json.loads(stdout.strip().splitlines()[0])
    assert result["kind"] == "folder" and result["perplexity"] > 1.0
    assert result["readout"] == {"affine": False, "additivity_error": None}


def test_eval_records_the_heldout_draw_and_the_dtype(ws, tmp_path):
    """`eval --output_json` with `--heldout_seed 1`, `--heldout_percentage 20` or `--dtype bfloat16` gave results
    whose losses differed while their JSON was otherwise the same: the held-out draw and the dtype were not recorded.
    The result now records the held-out seed, percentage and blocks and the weights' dtype: two results that differ
    in one of these options differ in that key (and, apart from the measures, in no other)."""
    measures = {"loss", "perplexity", "tokens", "readout"}

    def recorded(*extra: str) -> dict:
        result = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        code, _, stderr = run_main(evaluate(ws / "llama", *extra, "--output_json", str(result), data=ws / "corpus.txt"))
        assert code == 0, stderr[-2000:]
        return {k: v for k, v in json.loads(result.read_text()).items() if k not in measures}

    default = recorded()
    assert {k: default[k] for k in ("heldout_seed", "heldout_percentage", "heldout_blocks", "dtype")} == {
        "heldout_seed": 0,
        "heldout_percentage": 5.0,
        "heldout_blocks": 4,
        "dtype": "float32",
    }
    for extra, key, value in (
        (("--heldout_seed", "1"), "heldout_seed", 1),
        (("--heldout_percentage", "20"), "heldout_percentage", 20.0),
        (("--heldout_blocks", "2"), "heldout_blocks", 2),
        (("--dtype", "bfloat16"), "dtype", "bfloat16"),
    ):
        assert recorded(*extra) == {**default, key: value}, extra


def test_a_data_cache_in_a_dataset_folder_is_refused_before_it_spoils_the_folder(ws, tmp_path, monkeypatch):
    """eval --dataset_name DIR --data_cache_dir DIR/cache was accepted: datasets wrote dataset_info.json, .arrow and
    lock files into the user's data folder, and from then on every command (a taper without --data_cache_dir too)
    refused the folder after loading, its cache read as more of the corpus ("mixes file types", CastError)."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    texts, jsons = tmp_path / "textdir", tmp_path / "jdir"
    texts.mkdir()
    jsons.mkdir()
    documents = corpus_documents(150, seed=1)  # not the corpus: an out-of-corpus folder of it is refused
    (texts / "a.txt").write_text("\n\n".join(documents))
    (jsons / "a.json").write_text("\n".join(json.dumps({"text": d}) for d in documents))
    for option, extra in [("--dataset_name", []), ("--out_of_corpus_dataset", ["--out_of_corpus_blocks", "2"])]:
        for folder, cache in [(texts, texts / "cache"), (jsons, jsons / "c" / "d"), (texts, texts)]:
            argv = [
                *evaluate(ws / "llama", *extra, option, str(folder), data=ws / "corpus.txt"),
                "--data_cache_dir",
                str(cache),
            ]
            assert refused(argv) == (
                f"hf-tapernorm eval: error: --data_cache_dir '{cache}' lies in the {option} folder '{folder}': the "
                "cache's files would be read as more of the corpus by this and every later command on that folder; "
                "choose a --data_cache_dir outside it (or in a hidden folder of it, which is not read: '.cache')"
            )
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "a.txt", "jdir", "textdir"]
    # A hidden folder of it is not read (the loader skips hidden files and folders): a cache there is allowed.
    from types import SimpleNamespace

    from hf_tapernorm.app.data_checks import check_data_paths

    hidden = SimpleNamespace(
        dataset_name=str(texts),
        dataset_split="train",
        streaming=False,
        dataset_config_name=None,
        text_column=None,
        out_of_corpus_blocks=0,
        out_of_corpus_dataset=None,
        data_cache_dir=str(texts / ".c"),
    )
    check_data_paths(hidden)
    assert sorted(p.name for p in texts.iterdir()) == ["a.txt"]


def test_fold_scan_of_a_run_whose_corpus_is_gone_is_refused_before_loading(run, tmp_path, monkeypatch):
    """fold --scan_windows read the corpus its run recorded only after loading, patching, folding and checking the
    checkpoint and loading the reference model: a corpus deleted since was refused then."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    report = json.loads((copy / "report.json").read_text())
    gone = tmp_path / "corpus.txt"  # the run's corpus, deleted since
    edit_json(copy / "report.json", data={**report["data"], "source": str(gone), "dataset_path": str(gone)})
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert line == (
        f"hf-tapernorm fold: error: --scan_windows 2: the dataset '{gone}' that the run in '{copy}' recorded is not "
        "there; restore it at that path, or fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the "
        "export later, on any data)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


#: Hand edits of a run's report.json that fold's scan reads: (where, the edit, the value it records, what it must be).
EDITED_REPORTS = [
    ("data", {"heldout_seed": "x"}, "data.heldout_seed", '"x"', "an integer in [0, 4294967295]"),
    ("data", {"heldout_seed": None}, "data.heldout_seed", "null", "an integer in [0, 4294967295]"),
    ("data", {"heldout_seed": [7]}, "data.heldout_seed", "[7]", "an integer in [0, 4294967295]"),
    ("data", {"heldout_seed": 1.5}, "data.heldout_seed", "1.5", "an integer in [0, 4294967295]"),
    ("data", {"heldout_seed": -1}, "data.heldout_seed", "-1", "an integer in [0, 4294967295]"),
    ("data", {"block_size": "x"}, "data.block_size", '"x"', "an integer >= 4"),
    ("data", {"heldout_percentage": "ten"}, "data.heldout_percentage", '"ten"', "a number in (0, 100)"),
    ("data", {"sample_by": "page"}, "data.sample_by", '"page"', "one of line, paragraph, document"),
    ("data", {"split": 3}, "data.split", "3", "a string"),
    (None, {"data": "x"}, "data", '"x"', "an object"),
    ("evaluation_sets", {"held-out": {"blocks": None}}, "evaluation_sets.held-out.blocks", "null", "an integer >= 1"),
    ("evaluation_sets", {"held-out": "x"}, "evaluation_sets.held-out", '"x"', "an object"),
    (None, {"export": "x"}, "export", '"x"', "an object"),  # the fields that find the model it compares with
    ("model", {"source": [1]}, "model.source", "[1]", "a string"),
    (None, {"working_folder": 5}, "working_folder", "5", "a string"),
    ("data", {"block_size": 65}, "data.block_size", "65", "an integer within the models' 64 positions"),
    ("data", {"block_size": 100000}, "data.block_size", "100000", "an integer within the models' 64 positions"),
]


@pytest.mark.parametrize("section, edit, field, value, expected", EDITED_REPORTS)
def test_fold_scan_of_a_hand_edited_report_is_one_line_before_loading(
    run, tmp_path, monkeypatch, section, edit, field, value, expected
):
    """fold's scan read the fields of its run's report.json as it found them: a hand-edited one ("x", null or [7]
    as the held-out seed, "x" as the block size or the data section, "x" as the export section that names the
    baseline) failed with a traceback from scan_plan, and a seed of 1.5 or -1 was scanned as 1 and -1 (a seed eval
    refuses). Each field is now read with its type and range, and a wrong one is one line naming report.json and the
    field, with --scan_windows 0 as the way out, before any model loads."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    report = json.loads((copy / "report.json").read_text())
    edit_json(copy / "report.json", **({section: {**report[section], **edit}} if section else edit))
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert line == (
        f"hf-tapernorm fold: error: --scan_windows 2: the run's report.json ('{copy / 'report.json'}') records "
        f"{field} as {value}, not {expected}; fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans "
        "the export later, on any data)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_fold_scan_of_a_report_without_a_block_size_reads_the_default_and_refuses_it_past_the_positions(
    run, tmp_path, monkeypatch
):
    """A report.json whose data section was set to null reads as the default block size (128), past the tiny model's
    64 positions: fold loaded, folded and checked the model, then robustness_scan failed with a traceback (ValueError:
    "needs ... a block size within the model's positions"). The block size is checked against the positions of the
    checkpoint and the reference, read from their configs, before the weights load; 65 and 100000 likewise
    (EDITED_REPORTS)."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    edit_json(copy / "report.json", data=None)
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert line == (
        f"hf-tapernorm fold: error: --scan_windows 2: the run's report.json ('{copy / 'report.json'}') records no "
        "data.block_size, which reads as the default 128, past the models' 64 positions; fold with --scan_windows 0 "
        "(hf-tapernorm eval --scan_reference scans the export later, on any data)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


#: Hand edits of report.json's data section, each of the right type, that leave fold's scan no held-out block: the
#: edit, what the message says the report records, and why the split fills no block.
WHOLE = "the split takes whole documents"
SMALL_HELDOUT = [
    (
        {"heldout_percentage": 1e-9},
        'data.split null, data.sample_by "paragraph", data.heldout_percentage 1e-09',
        f"its held-out split (1e-09% of documents held out) does not fill one block of 32 tokens; it holds only 150 "
        f"document(s) and {WHOLE}",
    ),
    (
        {"split": "train[:10%]"},
        'data.split "train[:10%]", data.sample_by "paragraph", data.heldout_percentage 10.0',
        "its held-out split (10% of documents held out) does not fill one block of 32 tokens",
    ),
    (
        {"sample_by": "document"},
        'data.split null, data.sample_by "document", data.heldout_percentage 10.0',
        f"its held-out split (10% of documents held out) does not fill one block of 32 tokens; it holds only 1 "
        f"document(s) and {WHOLE}",
    ),
]


@pytest.mark.parametrize("edit, recorded, facts", SMALL_HELDOUT)
def test_fold_scan_of_a_report_that_leaves_no_heldout_block_is_refused_before_loading_in_folds_words(
    ws, run, tmp_path, monkeypatch, edit, recorded, facts
):
    """A report.json edited to a held-out percentage of 1e-9, the split train[:10%] or sample_by document (each of
    the right type) was refused only after the load, the fold and its check, in the words of taper's options
    ("--sample_by line", "a smaller --block_size"), which fold does not have. fold now draws the scan's texts with
    the checkpoint's tokenizer before the weights load, and refuses in one line naming report.json's fields and
    --scan_windows 0."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    report = json.loads((copy / "report.json").read_text())
    edit_json(copy / "report.json", data={**report["data"], **edit})
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert line == (
        f"hf-tapernorm fold: error: --scan_windows 2: the run's held-out text, read as its report.json "
        f"('{copy / 'report.json'}') records it ({recorded}, data.block_size 32), cannot be scanned: dataset "
        f"'{ws / 'corpus.txt'}' is too small: {facts}; fold with --scan_windows 0 (hf-tapernorm eval "
        "--scan_reference scans the export later, on any data)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_fold_scan_reads_a_report_that_records_an_unread_sample_by(ws, run, tmp_path):
    """taper and eval now refuse --sample_by line|document on a dataset that is not text files, which ignored it; a
    run of an earlier version recorded it all the same (sample_by "line" on a JSONL). fold's scan reads that report
    as it did: the value is still not read, so it does not break the fold (data_checks.check_data_paths, recorded)."""
    copy = copy_of(run, tmp_path)
    rows = tmp_path / "corpus.jsonl"
    paragraphs = (ws / "corpus.txt").read_text().split("\n\n")
    rows.write_text("".join(json.dumps({"text": text}) + "\n" for text in paragraphs))
    report = json.loads((copy / "report.json").read_text())
    edit_json(copy / "report.json", data={**report["data"], "sample_by": "line", "dataset_path": str(rows)})
    code, _, stderr = run_main(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert code == 0, stderr[-2000:]
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_fold_scan_of_an_out_of_corpus_text_that_fills_no_block_is_refused_before_loading(run, tmp_path, monkeypatch):
    """The scan's out-of-corpus text, drawn after the load and the fold, was refused there ("use more text or a
    smaller block size"); it is drawn with the held-out text before the weights load, and refused in fold's words."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    report = json.loads((copy / "report.json").read_text())
    edit_json(
        copy / "report.json",
        data={**report["data"], "out_of_corpus_dataset": str(short)},
        evaluation_sets={**report["evaluation_sets"], "out-of-corpus": {"blocks": 2, "description": "short"}},
    )
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert line == (
        f"hf-tapernorm fold: error: --scan_windows 2: the run's out-of-corpus text, read as its report.json "
        f"('{copy / 'report.json'}') records it (data.block_size 32), cannot be scanned: the out-of-corpus text (12 "
        "tokens) does not fill one block of 32 tokens; fold with --scan_windows 0 (hf-tapernorm eval "
        "--scan_reference scans the export later, on any data)"
    )


def test_eval_refuses_a_heldout_split_that_fills_no_block_before_loading(ws, run, monkeypatch):
    """eval --heldout_percentage 1e-9 loaded the model, then refused the held-out split: the texts are now drawn
    (with the model's own sink, read from its config) before the weights load."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for model in (run / "folded", run / "tapered"):
        line = refused(evaluate(model, "--heldout_percentage", "1e-9", data=ws / "corpus.txt"))
        assert line == (
            f"hf-tapernorm eval: error: dataset '{ws / 'corpus.txt'}' is too small: its held-out split (1e-09% of "
            "documents held out) does not fill one block of 32 tokens; it holds only 150 document(s) and the split "
            "takes whole documents: split the text into more lines or paragraphs (each of its documents is one line "
            "already)"
        )


@pytest.mark.parametrize("tokens", ["Infinity", "NaN", "1e400", "-384"])
def test_fold_leaves_a_token_count_that_is_no_finite_number_out_of_the_card(run, tmp_path, tokens):
    """report.json's training.tokens edited to Infinity, NaN or 1e400 (JSON that Python reads) made fold, with or
    without a scan, fail with a traceback (OverflowError, ValueError: int() of the float) while it wrote the card's
    facts. A count, step, weight or rate that is not a finite number >= 0 is left out of the card."""
    copy = copy_of(run, tmp_path)
    text = json.dumps(json.loads((copy / "report.json").read_text()))
    assert '"tokens": 384,' in text and '"learning_rate": 0.0001,' in text
    edited = text.replace('"tokens": 384,', f'"tokens": {tokens},').replace(
        '"learning_rate": 0.0001,', '"learning_rate": NaN,'
    )
    (copy / "report.json").write_text(edited)
    code, _, stderr = run_main(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "0"))
    assert code == 0, stderr[-2000:]
    section = _card_part((tmp_path / "export" / "README.md").read_text(), "## Tapering run")
    assert "| optimizer steps | 6 |" in section
    assert "Training tokens" not in section and "learning rate" not in section


def test_a_run_of_the_model_in_the_working_folder_folds_and_evaluates_with_its_scan(ws, tmp_path, monkeypatch):
    """A run tapered from inside the model's folder (`--model_name_or_path .`) records its model as ".", and every
    fold and eval of it with a scan failed with an IndexError (no hand edit: "." has no path parts). "." is the
    working folder the run recorded: the scan compares with the original model there, as taper's scan did."""
    model = tmp_path / "model"
    shutil.copytree(ws / "llama", model)
    monkeypatch.chdir(model)
    out = tmp_path / "dot_run"
    argv = [*taper(ws, out, "--scan_windows", "2"), "--model_name_or_path", "."]
    code, _, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["model"]["source"] == "."
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_main([*fold(out / "tapered", tmp_path / "export")[:-1], "2"])
    assert code == 0, stderr[-2000:]
    assert json.loads((tmp_path / "export" / "robustness_scan.json").read_text())["reference"] == "original"
    code, stdout, stderr = run_main(evaluate(out / "folded", "--scan_windows", "2", data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]


@pytest.mark.parametrize("field", ["model.source", "export.baseline_model"])
def test_a_report_naming_a_folder_without_a_model_as_the_scans_reference_is_refused_in_its_words(
    ws, run, tmp_path, monkeypatch, field
):
    """report.json's model.source or export.baseline_model edited to a folder that holds no model: fold refused it
    in one line that named a path the user never gave ("... is a folder without config.json"). It now names
    report.json and the field, with the way out, before any model loads. A name too long for the system to look up
    is no model there (an OSError before): the scan has no reference, and fold says so."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    report = json.loads((copy / "report.json").read_text())
    section, key = field.split(".")
    if (copy / "baseline").exists():  # the run's own baseline/model is what a copied run compares with first
        shutil.rmtree(copy / "baseline")
    # model.source is read where no baseline is recorded; a run recording its baseline's files skips one that changed
    edits = {"export": {**report["export"], "baseline_model": None, "baseline_contents": None}}
    edits[section] = {**edits.get(section, report[section]), key: str(ws)}
    edit_json(copy / "report.json", **edits)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["identity"].pop("model_contents")  # a run recording its original's files skips one that changed since
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "2"))
    name = "baseline" if section == "export" else "original"
    assert line.startswith(
        f"hf-tapernorm fold: error: --scan_windows 2: the {name} model that the run's report.json "
        f"('{copy / 'report.json'}') names in {field} cannot be read (model '{ws}' is a folder without config.json"
    )
    assert line.endswith(
        "; fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the export later, on any data)"
    )
    from hf_tapernorm.app.scan_reference import recorded_reference

    too_long = {**report, "export": {}, "model": {**report["model"], "source": "/" + "x" * 300}}
    assert recorded_reference(too_long, copy) is None  # not there: no reference (fold logs "no robustness scan")


def test_eval_refuses_a_block_size_past_its_scan_references_positions_before_loading(ws, tmp_path, monkeypatch):
    """eval's before-loading check compared --block_size with the evaluated model's positions only: a 128-position
    GPT-2 scanned against a 64-position reference with --block_size 100 loaded both models, evaluated, then failed
    with a traceback from the scan. The reference's positions are checked too, before any load (as fold does)."""
    import hf_tapernorm.cli.commands as commands

    gpt2 = save_tiny_model(tmp_path / "gpt2", "gpt2")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    argv = evaluate(gpt2, "--scan_windows", "2", "--scan_reference", str(ws / "llama"), data=ws / "corpus.txt")
    argv[argv.index("--block_size") + 1] = "100"
    assert refused(argv) == (
        f"hf-tapernorm eval: error: --block_size 100 (the scan's reference '{ws / 'llama'}' reads it too) exceeds the "
        "model's 64 positions"
    )


def _scan_reference_argv(ws: Path, reference: Path) -> list[str]:
    return evaluate(ws / "llama", "--scan_windows", "2", "--scan_reference", str(reference), data=ws / "corpus.txt")


def test_eval_refuses_a_scan_reference_whose_tokenizer_cannot_be_read_before_loading(ws, tmp_path, monkeypatch):
    """A damaged GGUF file as --scan_reference got "the scan reference <its folder> has no tokenizer: it is assumed
    to share the model's" (the wrong folder and the wrong reason); then the model loaded and the whole evaluation ran
    before "cannot load model". Now any reference tokenizer that is there but unreadable (the GGUF file, a damaged
    tokenizer.json) is refused in one line naming the file, before a model loads."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "gg").mkdir()
    gguf = tmp_path / "gg" / "bad.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert refused(_scan_reference_argv(ws, gguf)) == (
        f"hf-tapernorm eval: error: --scan_reference '{gguf}': its tokenizer cannot be read (error: unpack_from "
        "requires a buffer of at least 24 bytes for unpacking 20 bytes at offset 4 (actual buffer size is 15)), so "
        "the scan could not score the model's blocks with it: repair or replace it, or pass another --scan_reference"
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(ws / "llama", damaged)
    (damaged / "tokenizer.json").write_text("{not json")
    assert refused(_scan_reference_argv(ws, damaged)) == (
        f"hf-tapernorm eval: error: --scan_reference '{damaged}': its tokenizer cannot be read (JSONDecodeError: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)), so the scan could not score "
        "the model's blocks with it: repair or replace it, or pass another --scan_reference"
    )


def test_a_scan_reference_taken_as_a_hub_id_is_told_so_not_called_damaged(ws, tmp_path, monkeypatch):
    """--scan_reference someorg/somemodel (no local folder of that name, not in the cache, offline) was refused "its
    tokenizer cannot be read (...): repair or replace it": nothing was damaged. It says now, as --model_name_or_path
    does, that the name was taken as a Hub id, before a model loads."""
    import hf_tapernorm.cli.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no network retries for the Hub id
    monkeypatch.chdir(tmp_path)
    line = refused(_scan_reference_argv(ws, Path("someorg/somemodel")))
    assert line.startswith(
        "hf-tapernorm eval: error: --scan_reference 'someorg/somemodel': no local folder of that name, so it was "
        "taken as a Hub id, whose tokenizer cannot be read ("
    ), line
    assert line.endswith("): check the path, or the network and cache"), line


def test_a_scan_reference_folder_without_a_tokenizer_is_assumed_to_share_the_models(ws, tmp_path, monkeypatch, caplog):
    """A local folder that holds no tokenizer at all still passes the check with the WARNING, which names it."""
    import hf_tapernorm.cli.commands as commands

    loaded = []

    def stop(source, **kwargs):
        loaded.append(source.path)  # the check passed: the evaluated model is about to load
        raise ConfigurationError("stop here")

    monkeypatch.setattr(commands, "load_model", stop)
    bare = tmp_path / "bare"
    shutil.copytree(ws / "llama", bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with caplog.at_level(logging.WARNING):
        refused(_scan_reference_argv(ws, bare), "stop here")
    assert f"the scan reference {bare} has no tokenizer: it is assumed to share the model's" in caplog.text
    assert loaded == [str(ws / "llama")]


def test_eval_scan_of_a_run_whose_report_names_its_baseline_wrongly_is_one_line_before_loading(
    run, tmp_path, monkeypatch
):
    """eval --scan_windows of a run's tapered/ checkpoint read the report fields that find the model it compares with
    as it found them: "export": "x" (hand-edited) was a traceback (AttributeError) from app/record. It is now one
    line naming report.json and the field, with eval's ways out, before any model loads."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    edit_json(copy / "report.json", export="x")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(evaluate(copy / "tapered", "--scan_windows", "2", data=run.parent / "corpus.txt"))
    assert line == (
        f"hf-tapernorm eval: error: --scan_windows 2: the run's report.json ('{copy / 'report.json'}') records export "
        'as "x", not an object; name the model to compare with (--scan_reference), or evaluate with --scan_windows 0'
    )


def test_fold_without_a_scan_refuses_an_export_into_the_runs_dataset_and_takes_a_run_whose_dataset_is_gone(
    ws, run, tmp_path, monkeypatch
):
    """fold --scan_windows 0 wrote its export into the dataset folder its run recorded (only a scan checked it):
    afterwards every scan of that run, and every command on that folder, was refused as a mix of file types. The
    export is refused there whatever --scan_windows is; a recorded dataset that is gone protects nothing, and
    without a scan such a run still folds."""
    import hf_tapernorm.cli.commands as commands

    copy = copy_of(run, tmp_path)
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text((ws / "corpus.txt").read_text())
    report = json.loads((copy / "report.json").read_text())
    edit_json(copy / "report.json", data={**report["data"], "source": str(texts), "dataset_path": str(texts)})
    loaded = commands.load_model
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(copy / "tapered", texts / "exp", "--scan_windows", "0"))
    assert line == (
        f"hf-tapernorm fold: error: --output_dir '{texts / 'exp'}' lies inside the run's --dataset_name '{texts}', "
        f"which the taper run in '{copy}' reads: the export would become part of that input (every later command "
        "would read it changed); choose an --output_dir outside it"
    )
    assert sorted(p.name for p in texts.iterdir()) == ["a.txt"]
    monkeypatch.setattr(commands, "load_model", loaded)
    shutil.rmtree(texts)  # gone: without a scan, nothing to protect and nothing to read
    code, _, stderr = run_main(fold(copy / "tapered", tmp_path / "export", "--scan_windows", "0"))
    assert code == 0, stderr[-2000:]
    assert (tmp_path / "export" / "model.safetensors").is_file()


def _card_part(card: str, heading: str) -> str:
    """The lines of a model card from ``heading`` to the next heading."""
    start = card.index(heading)
    return card[start : card.index("\n## ", start + len(heading))]


def test_folds_card_names_the_base_model_and_the_tapering_run_as_tapers_card_does(run, tmp_path):
    """fold's card (the one push uploads) was titled after the checkpoint folder ("# tapered (norm-free)") and had no
    "Tapering run" section, where taper's card of the same run says "# llama (norm-free)" and names the training
    data, tokens and schedule. fold reads them from the run's report.json; a trainer checkpoint of the run (another
    schedule) gets the title alone."""
    code, _, stderr = run_main(fold(run / "tapered", tmp_path / "export", "--scan_windows", "0"))
    assert code == 0, stderr[-2000:]
    tapers, folds = ((folder / "README.md").read_text() for folder in (run / "folded", tmp_path / "export"))
    assert "\n# llama (norm-free)\n" in folds and "\n# llama (norm-free)\n" in tapers
    section = _card_part(folds, "## Tapering run")
    assert section == _card_part(tapers, "## Tapering run")
    assert "| Training data | " in section and "| optimizer steps | 6 |" in section
    code, _, stderr = run_main(fold(run / "checkpoint-6", tmp_path / "export6", "--scan_windows", "0"))
    assert code == 0, stderr[-2000:]
    card = (tmp_path / "export6" / "README.md").read_text()
    assert "\n# llama (norm-free)\n" in card and "## Tapering run" not in card


def test_fold_scans_the_text_its_run_read_as_the_run_read_it(ws, tmp_path, monkeypatch):
    """fold's scan read only the recorded dataset's name: a run on a cached Hub dataset (its --data_cache_dir) failed
    after the load, fold and check ("not cached"), and the out-of-corpus rows of a run made with
    --out_of_corpus_dataset scanned the Python documentation instead of the run's text."""
    import hf_tapernorm.cli.commands as commands

    cache = cached_hub_dataset(tmp_path / "hubcache", ws / "corpus.txt")
    ooc = tmp_path / "ooc.txt"
    ooc.write_text("\n\n".join(corpus_documents(150, seed=1)))  # not the corpus's documents: those are refused
    out = tmp_path / "run"
    extra = ["--dataset_name", "me/one", "--data_cache_dir", str(cache), "--out_of_corpus_dataset", str(ooc)]
    with hub_offline():
        finished_run([*taper(ws, out), *extra, "--out_of_corpus_blocks", "2"])
        read = []
        original = fold_scan.out_of_corpus_set
        monkeypatch.setattr(fold_scan, "out_of_corpus_set", lambda data, *a: read.append(data) or original(data, *a))
        code, _, stderr = run_main(fold(out / "tapered", tmp_path / "export", "--scan_windows", "2"))
        assert code == 0, stderr[-2000:]
        data = read[0]
        assert (data.dataset_name, data.data_cache_dir, data.out_of_corpus_dataset) == ("me/one", str(cache), str(ooc))
        scanned = json.loads((tmp_path / "export" / "robustness_scan.json").read_text())
        assert {row["text"] for row in scanned["rows"]} == {"held-out", "out-of-corpus"}
        (tmp_path / "me" / "one").mkdir(parents=True)  # a local folder of the Hub dataset's name, here
        (tmp_path / "me" / "one" / "other.txt").write_text("another text\n\n" * 400)
        monkeypatch.chdir(tmp_path)
        line = refused(fold(out / "tapered", tmp_path / "export3", "--scan_windows", "2"))
        assert "read the Hub dataset 'me/one', and 'me/one' here is a local path, which would be read" in line
        monkeypatch.chdir(ws)
        shutil.rmtree(cache)  # offline, the run's Hub dataset is gone: refused before anything loads
        monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
        line = refused(fold(out / "tapered", tmp_path / "export2", "--scan_windows", "2"))
    assert line.startswith(
        "hf-tapernorm fold: error: --scan_windows 2: the run's text cannot be read (--dataset_name: "
    )
    assert line.endswith(
        "fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the export later, on any data)"
    )


def test_fold_scans_the_heldout_draw_its_run_made(ws, tmp_path, monkeypatch):
    """A run made with --heldout_seed 3 did not record the seed, so fold's scan drew its held-out blocks and windows
    with the default seed: another draw than the run's report scanned. The seed is in the report's data section, and
    fold's scan draws with it."""

    out = tmp_path / "run"
    finished_run([*taper(ws, out), "--heldout_seed", "3"])
    assert json.loads((out / "report.json").read_text())["data"]["heldout_seed"] == 3
    read = []
    original = fold_scan.out_of_corpus_set
    monkeypatch.setattr(fold_scan, "out_of_corpus_set", lambda data, *a: read.append(data) or original(data, *a))
    code, _, stderr = run_main(fold(out / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert code == 0, stderr[-2000:]
    assert read[0].heldout_seed == 3


def test_fold_scans_the_out_of_corpus_text_from_the_column_its_run_read(ws, tmp_path, monkeypatch):
    """An --out_of_corpus_dataset without a `text` column (two string columns) could not be used: the reader had no
    text-column option. A run with --out_of_corpus_text_column records it beside the dataset, and fold's scan reads
    the same column; the report of an earlier version, without the key, reads as None (the default choice)."""
    import hf_tapernorm.cli.commands as commands

    docs = corpus_documents(150, seed=1)  # not the corpus's documents: those are refused
    ooc = tmp_path / "ooc.jsonl"
    ooc.write_text("".join(json.dumps({"body": d, "title": d[:9]}) + "\n" for d in reversed(docs)))
    extra = ["--out_of_corpus_dataset", str(ooc), "--out_of_corpus_text_column", "body", "--out_of_corpus_blocks", "2"]
    out = finished_run([*taper(ws, tmp_path / "run"), *extra])
    assert json.loads((out / "report.json").read_text())["data"]["out_of_corpus_text_column"] == "body"
    read = []
    original = fold_scan.out_of_corpus_set
    monkeypatch.setattr(fold_scan, "out_of_corpus_set", lambda data, *a: read.append(data) or original(data, *a))
    code, _, stderr = run_main(fold(out / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert code == 0, stderr[-2000:]
    assert (read[0].out_of_corpus_dataset, read[0].out_of_corpus_text_column) == (str(ooc), "body")
    report = json.loads((out / "report.json").read_text())
    edit_json(out / "report.json", data={k: v for k, v in report["data"].items() if k != "out_of_corpus_text_column"})
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    line = refused(fold(out / "tapered", tmp_path / "export2", "--scan_windows", "2"))
    cannot = "cannot tell which column holds the text (columns: body, title); pass --out_of_corpus_text_column)"
    assert f"dataset '{ooc}': {cannot}" in line


def test_fold_scans_a_home_path_in_the_home_of_its_run_and_never_creates_a_cache_that_is_gone(
    ws, tmp_path, monkeypatch
):
    """A run made with --dataset_name '~/corpus.txt' was scanned, under another HOME, on that home's corpus.txt
    without a word; a run whose recorded --data_cache_dir was moved since had it created again, full."""

    home = tmp_path / "home_a"
    home.mkdir()
    shutil.copy(ws / "corpus.txt", home / "corpus.txt")
    monkeypatch.setenv("HOME", str(home))
    cache = tmp_path / "cache"
    out = finished_run(taper(ws, tmp_path / "run", "--dataset_name", "~/corpus.txt", "--data_cache_dir", str(cache)))
    assert json.loads((out / "report.json").read_text())["home_folder"] == str(home)
    (tmp_path / "home_b").mkdir()
    (tmp_path / "home_b" / "corpus.txt").write_text("another user's text\n\n" * 400)
    monkeypatch.setenv("HOME", str(tmp_path / "home_b"))
    shutil.rmtree(cache)
    read = []
    original = fold_scan.out_of_corpus_set
    monkeypatch.setattr(fold_scan, "out_of_corpus_set", lambda data, *a: read.append(data) or original(data, *a))
    code, _, stderr = run_main(fold(out / "tapered", tmp_path / "export", "--scan_windows", "2"))
    assert code == 0, stderr[-2000:]
    assert (read[0].dataset_name, read[0].data_cache_dir) == (str(home / "corpus.txt"), None)
    assert not cache.exists()


def test_fold_never_scans_another_file_at_the_path_its_run_typed(ws, tmp_path, monkeypatch):
    """A run's dataset typed relative (`d/corpus.txt`), gone since; fold from another folder holding a d/corpus.txt
    scanned that file as the run's text, without a word. The report records where the run read its text."""
    import hf_tapernorm.cli.commands as commands

    (tmp_path / "a" / "d").mkdir(parents=True)
    shutil.copy(ws / "corpus.txt", tmp_path / "a" / "d" / "corpus.txt")
    monkeypatch.chdir(tmp_path / "a")
    out = finished_run(taper(ws, tmp_path / "run", "--dataset_name", "d/corpus.txt"))
    report = json.loads((out / "report.json").read_text())["data"]
    assert (report["source"], report["dataset_path"]) == ("d/corpus.txt", str(tmp_path / "a" / "d" / "corpus.txt"))
    (tmp_path / "a" / "d" / "corpus.txt").rename(tmp_path / "a" / "moved.txt")
    (tmp_path / "b" / "d").mkdir(parents=True)
    (tmp_path / "b" / "d" / "corpus.txt").write_text("another text\n\n" * 400)
    monkeypatch.chdir(tmp_path / "b")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    gone = tmp_path / "a" / "d" / "corpus.txt"
    expected = f"the dataset '{gone}' that the run in '{out}' recorded is not there"
    refused(fold(out / "tapered", tmp_path / "export", "--scan_windows", "2"), expected)


def test_a_cache_folder_of_its_own_in_a_run_folder_is_allowed_and_the_runs_folders_are_not(ws, baseline_run, tmp_path):
    """eval --data_cache_dir RUN/folded wrote the datasets cache into the export (push, taper --overwrite then
    refused the run and the export). The run's folders (its exports, checkpoints, baseline/) and the run folder
    itself are refused; a cache folder of its own in the run folder stays allowed, and a taper of that run adopts it."""
    copy = copy_of(baseline_run, tmp_path)
    before = {p.relative_to(copy).as_posix() for p in copy.rglob("*")}
    for cache, fragment in [
        (copy / "folded", f"lies in '{copy / 'folded'}', a saved model's folder"),
        (copy / "baseline" / "cache", f"lies in '{copy / 'baseline'}', which holds files of the run in '{copy}'"),
        (copy / "baseline" / "model" / "x", f"lies in '{copy / 'baseline' / 'model'}', a saved model's folder"),
        (copy, f"is the run folder '{copy}'"),
    ]:
        refused(evaluate(copy / "folded", "--data_cache_dir", str(cache), data=ws / "corpus.txt"), fragment)
        refused([*taper(ws, tmp_path / "other"), "--data_cache_dir", str(cache)], fragment)
    assert {p.relative_to(copy).as_posix() for p in copy.rglob("*")} == before
    own = copy / "cache"
    code, _, stderr = run_main(evaluate(copy / "folded", "--data_cache_dir", str(own), data=ws / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    assert any(own.iterdir())
    code, _, stderr = run_main([*taper(ws, copy, "--overwrite"), "--data_cache_dir", str(own)])  # its cache now
    assert code == 0, stderr[-2000:]


def test_a_command_after_the_main_thread_has_ended_blames_neither_model_nor_data(ws, monkeypatch):
    """eval or fold through cli.main in a worker thread, after an uncaught Ctrl-C ended the main thread: loading failed
    in the shutting-down interpreter ("cannot schedule new futures after interpreter shutdown"), said as "cannot load
    model '...'" or "could not load dataset '...'" as if either were broken, and a command whose first `import torch`
    came then was a traceback. Each says the main thread has ended, and that nothing more loads."""
    import threading

    import hf_tapernorm.data.sources as sources
    import hf_tapernorm.evaluation.models as models

    def shutting_down(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", shutting_down)
    monkeypatch.setattr(sources.datasets, "load_dataset_builder", shutting_down)
    source, corpus = resolve_model(str(ws / "llama")), str(ws / "corpus.txt")
    with pytest.raises(ModelSourceError, match="cannot schedule new futures"):
        load_model(source)  # the main thread runs: the loaders' own words
    with pytest.raises(DataError, match="cannot schedule new futures"):
        load_text_dataset(corpus)
    ended = (
        "the program's main thread has ended (it returned, or an error or Ctrl-C stopped it), and the interpreter "
        "shutting down loads nothing more; keep the main thread running until the command returns (join the thread "
        "that runs it)"
    )
    monkeypatch.setattr(threading, "main_thread", lambda: SimpleNamespace(is_alive=lambda: False))
    with pytest.raises(ModelSourceError) as refusal:
        load_model(source)
    assert str(refusal.value) == f"cannot load model '{ws / 'llama'}': {ended}"
    with pytest.raises(DataError) as refusal:
        load_text_dataset(corpus)
    assert str(refusal.value) == f"could not load dataset '{corpus}': {ended}"
    code, stdout, stderr = run_main(evaluate(ws / "llama", data=ws / "corpus.txt"))  # refused before any import
    assert (code, stdout, stderr.strip()) == (2, "", f"hf-tapernorm eval: error: {ended}")
