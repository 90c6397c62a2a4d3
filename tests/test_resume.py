"""Continuing, replacing or reusing a run: --resume of an interrupted or finished run is the same run (bit-identical
after SIGTERM or SIGKILL at any point) or is refused early naming what differs; --overwrite and --baseline_from
refuse what would lose or mix data.

Each case checks the exit code, the first line of the error, and the files on disk.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_tapernorm.app.run_folder import LOCK_NAME, MANIFEST_NAME
from hf_tapernorm.app.training_run import IDENTITY_NAME
from tests.conftest import build, corpus_documents, save_tiny_model, tiny_llama_config
from tests.helpers import (
    REPO,
    assert_same_weights,
    edit_json,
    error_line,
    error_of,
    finished_run,
    killable_argv,
    one_model_workspace,
    refused,
    run_main,
    signal_at_step,
    snapshot,
    truncate,
    uninterrupted_run,
)
from tests.helpers import SUBPROCESS_ENV as ENV
from tests.helpers import copy_run as copy_of
from tests.helpers import short_taper_argv as taper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def baseline_run(ws) -> Path:
    """A finished 6-step run with --baseline (its baseline/model and checkpoint-6 are what the cases point at)."""
    return finished_run(taper(ws, ws / "baseline_run", "--baseline"))


@pytest.fixture(scope="module")
def run(ws) -> Path:
    """A finished 6-step run (checkpoint-6, tapered/, folded/, report.json); cases edit copies of it."""
    return finished_run(taper(ws, ws / "run"))


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    """An uninterrupted run of the command the interruption tests kill (helpers.killable_argv)."""
    return uninterrupted_run(workspace, tmp_path_factory.mktemp("resume") / "reference")


def _files(folder: Path) -> dict[str, float]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


# ============================================================================= --overwrite, --baseline_from
def test_overwrite_refuses_a_model_or_baseline_inside_the_folder_it_deletes(ws, baseline_run, tmp_path):
    before = _files(baseline_run)
    inner = str(baseline_run / "baseline" / "model")
    refused(taper(ws, baseline_run, "--overwrite", model=inner), "--model_name_or_path", "inside --output_dir")
    refused(
        taper(ws, baseline_run, "--overwrite", "--baseline_from", str(baseline_run)), "--baseline_from", "--overwrite"
    )
    refused(taper(ws, baseline_run, "--resume", "--baseline", model=inner), "--model_name_or_path", "--resume")
    assert _files(baseline_run) == before  # nothing deleted, nothing rewritten


def test_baseline_from_a_run_with_other_options_is_refused_with_what_differs(ws, baseline_run, tmp_path):
    line = refused(taper(ws, tmp_path / "a", "--baseline_from", str(baseline_run), "--seed", "7"), "--baseline_from")
    assert "training.seed: 42 there, 7 now" in line
    # The default schedule decays from the taper's end: the user's --taper_end is named, not the value derived from it
    line = refused(
        taper(ws, tmp_path / "t", "--baseline_from", str(baseline_run), "--taper_end", "3"), "--baseline_from"
    )
    assert (
        "(--taper_end: 4 there, 3 now, and the learning rate decays from the taper's end (num_decay_steps: 2 there, "
        "3 now)): the gap would measure those" in line
    ), line
    assert not (tmp_path / "t").exists()
    refused(taper(ws, tmp_path / "b", "--baseline_from", str(baseline_run), steps=8), "training.max_steps: 6 there")
    # The recipe is not part of a baseline's identity (it never tapered); the same data and training options are.
    code, _, stderr = run_main(
        taper(ws, tmp_path / "c", "--baseline_from", str(baseline_run), "--distill_weight", "0", "--dtype", "float32")
    )  # --dtype float32: what the baseline run's unset --dtype loaded the float32 model in
    assert code == 0, stderr
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert report["export"]["baseline_model"] == str(baseline_run / "baseline" / "model")
    assert report["gap"]["tapered_vs_baseline"] is not None


def test_resume_refuses_a_baseline_from_given_other_weights_since(ws, baseline_run, tmp_path):
    """A --baseline_from run resumed after the baseline it names was given other weights: the resumed run measured
    its gap against that other model and re-recorded it as its baseline, without a word. It is refused, saying what
    changed; the unchanged baseline resumes."""
    baseline_copy = copy_of(baseline_run, tmp_path, "baseline_copy")
    argv = taper(ws, tmp_path / "run", "--baseline_from", str(baseline_copy), "--dtype", "float32")
    assert run_main(argv)[0] == 0
    code, _, stderr = run_main([*argv, "--resume"])
    assert code == 0, stderr
    save_tiny_model(baseline_copy / "baseline" / "model", "llama", seed=1)  # a fine-tune saved over it
    before = _files(tmp_path / "run")
    assert error_of([*argv, "--resume"]) == (
        f"hf-tapernorm taper: error: --resume: --baseline_from '{baseline_copy / 'baseline' / 'model'}' holds other "
        f"weight files or another config.json than when the run in '{tmp_path / 'run'}' recorded it, so the gap would "
        "be measured against another model: restore that baseline, or start over with --overwrite"
    )
    assert _files(tmp_path / "run") == before


def test_baseline_from_compares_with_what_the_baseline_trained_with(ws, baseline_run, tmp_path):
    """A finished --baseline run resumed with --allow_changes max_grad_norm trains no step, yet recorded 0.5 as the
    run's option: --baseline_from then accepted a 0.5 run and refused a 1.0 one, the value the baseline trained with.
    The baseline's own newest checkpoint says what it trained with."""
    resumed = copy_of(baseline_run, tmp_path, "resumed")
    code, _, stderr = run_main(
        [*taper(ws, resumed, "--baseline"), "--resume", "--max_grad_norm", "0.5", "--allow_changes", "max_grad_norm"]
    )
    assert code == 0, stderr
    argv = taper(ws, tmp_path / "named", "--baseline_from", str(resumed), "--dtype", "float32")
    code, _, stderr = run_main(argv)
    assert code == 0, stderr
    line = refused(taper(ws, tmp_path / "other", "--baseline_from", str(resumed), "--max_grad_norm", "0.5"))
    assert "training.max_grad_norm: 1.0 there, 0.5 now" in line, line


def test_baseline_from_takes_a_model_folder_given_notes_since(ws, baseline_run, tmp_path):
    """A README.md added to the model folder after the --baseline run refused --baseline_from ("model_contents.
    README.md: None there, ... now"), though --resume leaves a model folder's notes, card and licence out of what it
    compares; so does --baseline_from now."""
    model = Path(shutil.copytree(ws / "llama", tmp_path / "llama"))
    argv = taper(ws, tmp_path / "base", "--baseline", model=str(model))
    assert run_main(argv)[0] == 0
    (model / "README.md").write_text("# my model\n")
    (model / "LICENSE").write_text("MIT\n")
    argv = taper(ws, tmp_path / "named", "--baseline_from", str(tmp_path / "base"), model=str(model))
    code, _, stderr = run_main(argv)
    assert code == 0, stderr


def test_resume_compares_a_dataset_folders_data_files_not_its_notes(ws, tmp_path, caplog):
    """A run on a folder of JSON Lines refused --resume after a notes.md was added beside them
    ("data.contents.notes.md: None in the run, ... now"), though a folder of tables reads no .md file as data. The
    files read as data are compared; a new data file still refuses. A misspelt --allow_changes name that allowed
    nothing on a resume that went ahead was not said."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [json.dumps({"text": text}) for text in corpus_documents(150)]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    argv = taper(ws, tmp_path / "run", data=str(data))
    assert run_main(argv)[0] == 0
    (data / "notes.md").write_text("where these rows came from\n")
    caplog.set_level(logging.WARNING, logger="hf_tapernorm")
    code, _, stderr = run_main([*argv, "--resume", "--allow_changes", "max_grad_nrom"])
    assert code == 0, stderr
    assert (
        "--allow_changes max_grad_nrom: names nothing --resume compares (the options that shape the result, the "
        "model's and the data's files), so it allowed nothing"
    ) in caplog.text
    caplog.clear()
    code, _, stderr = run_main([*argv, "--resume", "--allow_changes=--max-grad-norm"])  # the flag as typed names it
    assert code == 0 and "names nothing" not in caplog.text, stderr
    (data / "more.jsonl").write_text(rows[0] + "\n")
    assert "data.contents.more.jsonl: None in the run" in error_of([*argv, "--resume"])


def test_a_run_killed_during_its_export_can_be_overwritten(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.move(run / "folded", run / ".folded.partial-99999")  # what a kill before the rename leaves
    manifest = json.loads((run / MANIFEST_NAME).read_text())
    (run / MANIFEST_NAME).write_text(json.dumps({**manifest, "writes": [".folded.partial-99999"]}))  # recorded first
    (run / LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))  # no such process
    code, _, stderr = run_main([*killable_argv(workspace, run), "--overwrite"])
    assert code == 0, stderr
    assert not list(run.glob(".*.partial-*")) and not (run / LOCK_NAME).exists()
    assert_same_weights(run, reference)


def _fold_killed_while_writing(folded: Path) -> int:
    """What ``fold --output_dir RUN/folded --overwrite`` killed by SIGKILL mid-write leaves (the real RunLock and
    write_folder, in a forked child): folded/'s lock, and the marked ``.folded.partial-PID/`` beside it; its pid."""
    from hf_tapernorm.app.folder_writes import write_folder
    from hf_tapernorm.app.run_lock import RunLock

    child = os.fork()
    if child == 0:
        try:
            RunLock(folded).acquire()

            def killed(new: Path) -> None:
                new.mkdir()
                (new / "config.json").write_text("{}")
                os.kill(os.getpid(), signal.SIGKILL)

            write_folder(folded, killed)
        finally:
            os._exit(1)
    assert os.waitpid(child, 0)[1] == signal.SIGKILL
    return child


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
def test_what_a_killed_fold_into_the_run_left_is_not_the_users(ws, run, tmp_path, option):
    """A fold into the run's folded/ killed by SIGKILL left folded/'s lock and its marked temporary folder, and
    --overwrite and --resume refused them as files hf-tapernorm did not write: its own leftovers, now deleted.
    A lock whose holder runs is still refused, and a look-alike without the mark is still named and kept."""
    folder = copy_of(run, tmp_path)
    pid = _fold_killed_while_writing(folder / "folded")
    assert (folder / "folded" / LOCK_NAME).is_file() and (folder / f".folded.partial-{pid}" / "w").is_dir()
    (folder / ".folded.partial-1").mkdir()  # a user's look-alike: no mark
    (folder / ".folded.partial-1" / "notes.txt").write_text("mine")
    refused(taper(ws, folder, option), "did not write (.folded.partial-1/notes.txt)")
    shutil.rmtree(folder / ".folded.partial-1")
    (folder / "mine").mkdir()  # a file named like a lock that holds no lock record
    (folder / "mine" / LOCK_NAME).write_text("not a lock")
    refused(taper(ws, folder, option), f"mine/{LOCK_NAME}")
    assert (folder / "mine" / LOCK_NAME).read_text() == "not a lock"
    shutil.rmtree(folder / "mine")
    code, _, stderr = run_main(taper(ws, folder, option))
    assert code == 0, stderr[-2000:]
    assert not (folder / "folded" / LOCK_NAME).exists() and not list(folder.glob(".folded.*"))
    assert (folder / "folded" / "model.safetensors").is_file()
    holder = subprocess.Popen(  # a fold that runs: its lock stays, and the run is refused
        [sys.executable, "-c", f"from hf_tapernorm.app.run_lock import RunLock; from pathlib import Path; "
         f"RunLock(Path({str(folder / 'folded')!r})).acquire(); print('held', flush=True); input()"],
        cwd=REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        record = (folder / "folded" / LOCK_NAME).read_bytes()
        line = refused(taper(ws, folder, option), f"folded/{LOCK_NAME}")
        assert (folder / "folded" / LOCK_NAME).read_bytes() == record, line
    finally:
        holder.kill()
        holder.wait()


# ============================================================================= --resume: the same run, or refused
def test_resume_with_another_dtype_is_refused(ws, baseline_run):
    line = refused(taper(ws, baseline_run, "--resume", "--baseline", "--dtype", "bfloat16"), "--resume")
    assert "dtype: 'float32' in the run, 'bfloat16' now" in line  # the run's: unset, the model's own float32


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_resume_with_the_dtype_the_run_resolved_is_the_same_run(ws, run, tmp_path, dtype):
    """The run started without --dtype on a float32 model: "dtype: None in the run, 'float32' now" refused it."""
    folder = copy_of(run, tmp_path)
    shutil.rmtree(folder / "folded")
    code, _, stderr = run_main(taper(ws, folder, "--resume", "--dtype", dtype))
    assert code == 0, stderr[-2000:]
    assert (folder / "folded" / "model.safetensors").read_bytes() == (run / "folded" / "model.safetensors").read_bytes()


def test_resume_with_the_keep_norms_in_another_order_is_the_same_run(ws, run, tmp_path):
    """--keep_norms 'B,A' (or with a pattern given twice) for a run started with 'A,B' was refused ("taper.keep_norms:
    ['A', 'B'] in the run, ['B', 'A'] now"): keep_norms is a set of patterns, and the run's identity lists it so."""
    folder = copy_of(run, tmp_path)
    shutil.rmtree(folder / "folded")
    kept = json.loads((run / "report.json").read_text())["taper"]["keep_norms"]
    assert len(kept) > 1
    code, _, stderr = run_main(taper(ws, folder, "--resume", "--keep_norms", ",".join([*reversed(kept), kept[0]])))
    assert code == 0, stderr[-2000:]
    assert (folder / "folded" / "model.safetensors").read_bytes() == (run / "folded" / "model.safetensors").read_bytes()


def test_keep_norms_recorded_in_another_order_by_an_older_version_is_the_same_recipe():
    """A run identity of an older version lists keep_norms as typed; it compares as the same set, and another set of
    patterns is still refused by name."""
    from types import SimpleNamespace

    from hf_tapernorm import ConfigurationError, TaperNormConfig
    from hf_tapernorm.app.validation import check_resume_identity

    recorded = {**TaperNormConfig.paper().options(), "keep_norms": ["b", "a"]}  # unsorted, as typed
    folder = SimpleNamespace(path="run", manifest=lambda: {"identity": {"taper": recorded}})

    def identity(*patterns: str) -> dict:
        return {"taper": TaperNormConfig.paper(keep_norms=list(patterns)).options()}

    assert check_resume_identity(folder, identity("a", "b"), set()) == {}
    assert check_resume_identity(folder, identity("b", "a", "b"), set()) == {}
    with pytest.raises(ConfigurationError, match=r"taper\.keep_norms: \['a', 'b'\] in the run, \['a'\] now"):
        check_resume_identity(folder, identity("a"), set())


def test_allow_changes_names_an_option_it_can_allow(ws, run, tmp_path):
    """--help's example was 'learning_rate', which a resume can never change."""
    from hf_tapernorm.cli.arguments import RunArguments

    text = next(f for f in dataclasses.fields(RunArguments) if f.name == "allow_changes").metadata["help"]
    assert "e.g. 'max_grad_norm'" in text and "learning_rate" in text.split("cannot change")[1]
    folder = copy_of(run, tmp_path)
    line = refused(
        taper(ws, folder, "--resume", "--learning_rate", "2e-4", "--allow_changes", "learning_rate"),
        "--allow_changes cannot allow learning_rate: a resumed Trainer restores training.learning_rate",
    )
    assert "start over with --overwrite" in line
    shutil.rmtree(folder / "folded")
    code, _, stderr = run_main(
        taper(ws, folder, "--resume", "--max_grad_norm", "0.5", "--allow_changes", "max_grad_norm")
    )
    assert code == 0, stderr[-2000:]
    report = json.loads((folder / "report.json").read_text())
    assert report["allowed_changes"] == {"training.max_grad_norm": {"run": 1.0, "now": 0.5}}


def test_resume_names_the_same_model_and_data_by_another_path(ws, baseline_run, tmp_path, monkeypatch):
    copy = tmp_path / "run"
    shutil.copytree(baseline_run, copy)
    monkeypatch.chdir(ws)  # the run recorded absolute paths; name them relative now
    arguments = taper(ws, copy, "--resume", "--baseline", model="llama")
    arguments[arguments.index("--dataset_name") + 1] = "corpus.txt"
    code, _, stderr = run_main(arguments)
    assert code == 0, stderr
    # Another file under the same name is still another dataset.
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(150, seed=3)))
    monkeypatch.chdir(tmp_path)
    arguments = taper(ws, copy, "--resume", "--baseline")
    arguments[arguments.index("--dataset_name") + 1] = "corpus.txt"
    refused(arguments, "data.contents")


def test_a_refused_resume_keeps_the_recorded_identity(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for folder in ("checkpoint-10", "tapered", "folded"):  # back to the run's state at its step-9 checkpoint
        shutil.rmtree(run / folder)
    assert (run / "checkpoint-9").is_dir()
    identity = json.loads((run / MANIFEST_NAME).read_text())["identity"]
    # The gate was 0 at step 9; a taper that starts at step 9 says 1 there: the resume is refused in training.
    changed = [*killable_argv(workspace, run), "--taper_start", "9", "--taper_end", "10"]
    allowed = "taper_start,taper_end,lr_scheduler_kwargs,num_decay_steps"
    message = error_of([*changed, "--resume", "--allow_changes", allowed], code=2)
    assert "resuming at step 9" in message, message
    assert json.loads((run / MANIFEST_NAME).read_text())["identity"] == identity
    code, _, stderr = run_main([*killable_argv(workspace, run), "--resume"])
    assert code == 0, stderr
    assert_same_weights(run, reference)


def test_a_lost_manifest_is_rebuilt_from_the_checkpoint_record(workspace, reference, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "folded")
    (run / MANIFEST_NAME).write_text('{"tool": "hf-tap')  # truncated
    code, _, stderr = run_main([*killable_argv(workspace, run), "--resume"])
    assert code == 0, stderr
    assert "rebuilding the lost manifest" in caplog.text
    assert_same_weights(run, reference)
    (run / MANIFEST_NAME).unlink()
    (run / "mine.txt").write_text("user file")
    message = error_of([*killable_argv(workspace, run), "--resume"])
    assert "holds files this command did not write (mine.txt)" in message
    for checkpoint in run.glob("checkpoint-*"):
        (checkpoint / "tapernorm_run.json").unlink()
    (run / MANIFEST_NAME).unlink(missing_ok=True)
    message = error_of([*killable_argv(workspace, run), "--resume"])
    assert "is missing or unreadable and no checkpoint" in message or "incomplete" in message, message


def test_resume_refuses_a_checkpoint_without_its_optimizer_state(workspace, reference, tmp_path):
    for name, expected in (
        ("optimizer.pt", "has no optimizer.pt, which holds the optimizer's moments"),
        ("scheduler.pt", "has no scheduler.pt"),
        ("rng_state.pth", "has no rng_state.pth"),
        ("model.safetensors", "has no model.safetensors"),
    ):
        run = tmp_path / name
        shutil.copytree(reference, run)
        (run / "checkpoint-10" / name).unlink()
        before = snapshot(run)
        message = error_of([*killable_argv(workspace, run), "--resume"])
        assert message.startswith(f"hf-tapernorm taper: error: --resume: {run / 'checkpoint-10'} {expected}"), message
        assert message.endswith(
            "restore it from a copy, move it out of the run folder to resume from the checkpoint before it, "
            "or start over with --overwrite"
        )
        assert snapshot(run) == before
    run = tmp_path / "truncated"
    shutil.copytree(reference, run)
    weights = run / "checkpoint-10" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "cannot read" in error_of([*killable_argv(workspace, run), "--resume"])


def test_resume_refuses_a_renamed_checkpoint_before_loading_anything(workspace, reference, tmp_path, monkeypatch):
    """checkpoint-10 renamed checkpoint-010 (its number, read as an int, is still its step): --resume packed the
    data, loaded and patched the model and started the Trainer, which looked for checkpoint-10, then wrote a failed
    report and plots into the run folder."""
    import hf_tapernorm.app.taper as pipeline

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "checkpoint-10").rename(run / "checkpoint-010")
    before = snapshot(run)
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    message = error_of([*killable_argv(workspace, run), "--resume"])
    assert message == (
        f"hf-tapernorm taper: error: --resume: {run / 'checkpoint-010'} holds the state of step 10 "
        "(trainer_state.json: global_step 10), and its name is not checkpoint-10: it was renamed; rename it back to "
        f"{run / 'checkpoint-10'}, or start over with --overwrite"
    ), message
    assert snapshot(run) == before


def test_resume_checks_the_data_contents_and_every_option_that_shapes_the_result(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    corpus = tmp_path / "corpus.txt"
    shutil.copy(workspace / "corpus.txt", corpus)
    argv = killable_argv(workspace, run)
    argv[argv.index("--dataset_name") + 1] = str(corpus)
    (run / MANIFEST_NAME).write_text(  # the run as if it had read this copy (same bytes, another path)
        (run / MANIFEST_NAME).read_text().replace(str(workspace / "corpus.txt"), str(corpus))
    )
    corpus.write_text(corpus.read_text() + "\n\nanother document at the end")
    before = snapshot(run)
    message = error_of([*argv, "--resume"])
    assert "data.contents.corpus.txt: '" in message and "--allow_changes" in message, message
    shutil.copy(workspace / "corpus.txt", corpus)
    message = error_of([*argv, "--resume", "--adam_beta2", "0.9"])
    assert "training.adam_beta2: 0.95 in the run, 0.9 now" in message
    assert snapshot(run) == before
    code, _, stderr = run_main([*argv, "--resume", "--save_steps", "5", "--logging_steps", "2"])  # bookkeeping only
    assert code == 0, stderr
    message = error_of([*argv, "--resume", "--adam_beta2", "0.9", "--allow_changes", "adam_beta2"])
    assert "a resumed Trainer restores training.adam_beta2 from the checkpoint's optimizer" in message
    assert json.loads((run / MANIFEST_NAME).read_text())["identity"]["training"]["adam_beta2"] == 0.95
    code, _, stderr = run_main([*argv, "--resume", "--max_grad_norm", "0.5", "--allow_changes", "max_grad_norm"])
    assert code == 0, stderr
    report = json.loads((run / "report.json").read_text())
    assert report["allowed_changes"]["training.max_grad_norm"] == {"run": 1.0, "now": 0.5}
    corpus.write_text(corpus.read_text() + "\n\nanother document at the end")
    argv += ["--resume", "--max_grad_norm", "0.5"]
    for extension in ("txt", "json"):  # a changed file is named by its name, not its extension
        message = error_of([*argv, "--allow_changes", extension])
        assert "data.contents.corpus.txt: '" in message, message
        assert f"(--allow_changes {extension} names none of them)" in message, message
    message = error_of([*argv, "--allow_changes", str(corpus)])  # a path as typed names no change
    assert f"(--allow_changes {corpus} names none of them). Rerun with the original options" in message
    code, _, stderr = run_main([*argv, "--allow_changes=--max-grad-norm,corpus.txt"])  # the flag as typed, too
    assert code == 0, stderr
    assert "data.contents.corpus.txt" in json.loads((run / "report.json").read_text())["allowed_changes"]


def test_resume_refuses_other_weights_of_the_same_size(workspace, reference, tmp_path):
    """The weights were identified by their size: a fine-tune saved over the base model resumed silently, with
    the report's original-model figures (and a distillation teacher) of other weights. A notes file or a licence
    added beside the model, which no load reads, was refused as a change; it resumes."""
    run, model = tmp_path / "run", tmp_path / "model"
    shutil.copytree(reference, run)
    shutil.copytree(workspace / "llama", model)
    argv = killable_argv(workspace, run)
    argv[argv.index("--model_name_or_path") + 1] = str(model)
    for path in (run / MANIFEST_NAME, *run.glob("checkpoint-*/tapernorm_run.json")):
        path.write_text(path.read_text().replace(str(workspace / "llama"), str(model)))  # as if it had read the copy
    (model / "NOTES.md").write_text("my notes\n")  # beside the model, read by no load: the same model
    (model / "LICENSE").write_text("Apache-2.0\n")
    code, _, stderr = run_main([*argv, "--resume"])
    assert code == 0, stderr
    size = (model / "model.safetensors").stat().st_size
    build(tiny_llama_config(), seed=7).save_pretrained(model)  # other weights, the same size
    assert (model / "model.safetensors").stat().st_size == size
    before = snapshot(run)
    message = error_of([*argv, "--resume"])
    assert "model_contents.model.safetensors: " in message and "--allow_changes" in message, message
    assert snapshot(run) == before


def test_a_legacy_weight_fingerprint_still_resumes():
    from hf_tapernorm.app.fingerprints import with_legacy_fingerprints

    saved = {"model_contents": {"model.safetensors": "100 bytes", "config.json": "abc"}}
    now = {"model_contents": {"model.safetensors": "100 bytes, sampled sha256 ff", "config.json": "abc"}}
    assert with_legacy_fingerprints(saved, now)["model_contents"] == saved["model_contents"]
    other = {"model_contents": {"model.safetensors": "101 bytes, sampled sha256 ff", "config.json": "abc"}}
    assert with_legacy_fingerprints(saved, other) == other


def test_a_models_hidden_folders_are_no_part_of_its_fingerprint(tmp_path):
    """A model fetched by git clone had its .git/ files fingerprinted: any git action there (a commit, a fetch)
    refused --resume ("model_contents..git/COMMIT_EDITMSG ...") and dropped the scan against the original. Files in
    hidden folders (.git/, .cache/ of a Hub download) are no part of a model's or dataset's contents, and a run an
    older version recorded with them is compared without them; a single dataset file named with a dot still is its
    own contents (--resume of a run on ".corpus.txt" was refused)."""
    from hf_tapernorm.app.fingerprints import compared_identity, fingerprint, holds_recorded_contents

    model = tmp_path / "model"
    (model / ".git" / "logs").mkdir(parents=True)
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / ".git" / "logs" / "HEAD").write_text("commit\n")
    (model / ".cache" / "huggingface" / "config.json.metadata").write_text("etag\n")
    (model / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    found = fingerprint(str(model), weights_by_size=True)
    assert sorted(found) == ["config.json", "model.safetensors"]
    older = {**found, ".git/logs/HEAD": "0" * 64, ".cache/huggingface/config.json.metadata": "1" * 64}
    assert holds_recorded_contents(str(model), older)
    saved = {"model_contents": older, "data": {"contents": {"a.txt": "2" * 64, ".git/HEAD": "3" * 64}}}
    assert compared_identity(saved) == {"model_contents": found, "data": {"contents": {"a.txt": "2" * 64}}}
    hidden_file = tmp_path / ".corpus.txt"  # a dataset file named with a dot is the data itself
    hidden_file.write_text("text\n")
    (model / "README.md").write_text("# a model card, edited\n")  # documentation beside the model: no part of it
    (model / "LICENSE.txt").write_text("MIT\n")
    assert holds_recorded_contents(str(model), found)
    saved = {"model_contents": {**found, "NOTES.md": "4" * 64}, "data": {"contents": {"README.md": "5" * 64}}}
    assert compared_identity(saved) == {"model_contents": found, "data": {"contents": {"README.md": "5" * 64}}}
    recorded = {"data": {"contents": fingerprint(str(hidden_file))}}
    assert compared_identity(recorded) == recorded and list(recorded["data"]["contents"]) == [".corpus.txt"]


@pytest.mark.parametrize("edit", ["delete tapered/", "truncate report.json", "edit tapered/tapernorm_config.json"])
def test_resume_of_a_finished_run_edited_by_hand_restores_its_outputs(ws, run, tmp_path, edit):
    folder = copy_of(run, tmp_path)
    if edit == "delete tapered/":
        shutil.rmtree(folder / "tapered")
    elif edit == "truncate report.json":
        truncate(folder / "report.json", 100)
    else:
        edit_json(folder / "tapered" / "tapernorm_config.json", scope="final")
    code, _, stderr = run_main(taper(ws, folder, "--resume"))
    assert code == 0, stderr[-2000:]
    assert json.loads((folder / "report.json").read_text())["status"] == "finished"
    assert json.loads((folder / "tapered" / "tapernorm_config.json").read_text())["scope"] == "all"  # the recipe's
    assert (folder / "tapered" / "model.safetensors").read_bytes() == (
        run / "tapered" / "model.safetensors"
    ).read_bytes()


def test_a_refused_resume_of_a_finished_run_keeps_its_report(ws, run, tmp_path):
    folder = copy_of(run, tmp_path)
    # a checkpoint of another recipe, its identity record edited alike: only TaperCallback, after loading, sees it
    edit_json(folder / "checkpoint-6" / "tapernorm_config.json", ema_rate=0.5)
    identity = json.loads((folder / "checkpoint-6" / IDENTITY_NAME).read_text())
    identity["taper"]["ema_rate"] = 0.5
    (folder / "checkpoint-6" / IDENTITY_NAME).write_text(json.dumps(identity))
    report = (folder / "report.json").read_bytes()
    assert "another TaperNormConfig" in error_line(taper(ws, folder, "--resume"))
    assert (folder / "report.json").read_bytes() == report  # was replaced by a "failed" report without results


# ============================================================================= signals and kills
def test_sigterm_saves_a_checkpoint_and_resume_is_bit_identical(workspace, reference, tmp_path):
    out = tmp_path / "run"
    code, output = signal_at_step(killable_argv(workspace, out), ENV, step=4, signum=signal.SIGTERM)
    assert code == 143, output
    assert "SIGTERM: stopping after this step with a checkpoint" in output
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    assert [c.name for c in checkpoints] == ["checkpoint-3", "checkpoint-4"]  # every 3 steps, and the signal's
    assert not (out / LOCK_NAME).exists()
    code, _, stderr = run_main([*killable_argv(workspace, out), "--resume"])
    assert code == 0, stderr
    assert_same_weights(out, reference)


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import hf_tapernorm.app.taper as taper
    import hf_tapernorm.app.training_run as training_run
    from transformers import Trainer
    POINT = sys.argv[1]

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when=lambda *a, **k: True):
        original = getattr(owner, name)
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if when(*args, **kwargs):
                kill()
            return result
        setattr(owner, name, wrapped)

    if POINT == "after_checkpoint":  # the step-6 checkpoint is whole and recorded
        after(training_run.RecordCallback, "on_save", lambda self, args, state, *a, **k: state.global_step == 6)
    elif POINT == "checkpoint_write":  # the step-6 checkpoint has weights and optimizer, no RNG state yet
        after(Trainer, "_save_optimizer_and_scheduler", lambda self, *a, **k: self.state.global_step == 6)
    elif POINT == "evaluation":
        after(taper, "evaluate_set", lambda models, evaluation, **k: evaluation.name == "held-out")
    elif POINT == "export":  # the export is written into its temporary folder, not renamed yet
        after(taper, "save_export")
    elif POINT == "report":
        after(taper, "write_report", lambda output_dir, record: record.status == "finished")
    from hf_tapernorm.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize("point", ["after_checkpoint", "checkpoint_write", "evaluation", "export", "report"])
def test_sigkill_at_any_point_then_resume_is_bit_identical(workspace, reference, tmp_path, point, caplog):
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    done = subprocess.run(
        [sys.executable, str(script), point, *killable_argv(workspace, out)], cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert (out / LOCK_NAME).exists()  # the killed process could not release it
    if point == "export":
        assert list(out.glob(".folded.partial-*"))
    code, _, stderr = run_main([*killable_argv(workspace, out), "--resume"])
    assert code == 0, stderr
    assert "taking over the lock" in caplog.text
    assert not list(out.glob(".*.partial-*")) and not (out / LOCK_NAME).exists()
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and [r["step"] for r in report["history"]] == list(range(1, 11))
    assert_same_weights(out, reference)


def test_sigterm_outside_training_unwinds_the_command(monkeypatch):
    cli = importlib.import_module("hf_tapernorm.cli.main")  # the package exports main(), which hides the module

    def busy(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return 0

    original = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(cli.COMMANDS, "fold", (busy, "stand-in"))
    code, _, stderr = run_main(["fold"])
    assert code == 143 and stderr.strip().endswith("hf-tapernorm fold: terminated")
    assert signal.getsignal(signal.SIGTERM) is original
