"""Never lose a run: every bad input fails early with one line, and no destructive path touches a foreign file.

Each case checks the exit code, the message, and, where files could be lost, that every file of the
folder is byte-for-byte what it was.
"""

from __future__ import annotations

import errno
import json
import math
import resource
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_tapernorm import (
    ConfigurationError,
    TaperCallback,
    TaperController,
    TaperDivergenceError,
    TaperNormConfig,
    TaperStateError,
    UnsupportedModelError,
    load_tapered,
    patch_model,
    save_tapered,
)
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import DivergenceThresholds, TaperSchedule, calibrate
from tests.conftest import build, random_batches, tiny_llama_config
from tests.helpers import SUBPROCESS_ENV, error_of, run_main, short_fold_argv, short_taper_argv, snapshot, taper_argv


@pytest.fixture(scope="module")
def finished(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "run"
    code, _, stderr = run_main(taper_argv(workspace, out, "--distill_weight", "0", steps=8))
    assert code == 0, stderr
    return out


# ----------------------------------------------------------------------------- a disk that fills up during the run
def _file_size_limit() -> None:
    """``ulimit -f 60`` (60 KiB) in the child, which gets EFBIG past it (SIGXFSZ ignored, as Python does itself)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (60 * 1024, 60 * 1024))


def test_a_file_size_limit_hit_by_the_first_checkpoint_is_one_line_with_no_checkpoint_to_resume(workspace, tmp_path):
    """It was a SafetensorError traceback ("File too large (os error 27)") and exit 1 (fold already said it in one
    line); now one line naming --output_dir and that no complete checkpoint was kept, and the report says why."""
    run_main(short_taper_argv(workspace, tmp_path / "warm", "--max_steps", "1"))  # the data cache, written unlimited
    out = tmp_path / "run"
    argv = short_taper_argv(workspace, out, "--save_steps", "3")
    done = subprocess.run(
        [sys.executable, "-m", "hf_tapernorm.cli", *argv], env=SUBPROCESS_ENV, preexec_fn=_file_size_limit,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert line == (
        f"hf-tapernorm taper: error: --output_dir {out}: its disk could not take what the run writes "
        "(SafetensorError: Error while serializing: I/O error: File too large (os error 27)); it kept no complete "
        "checkpoint for --resume to continue from: free space (or lift the file-size limit) and start over with "
        "--overwrite, or choose an --output_dir on another disk"
    ), line
    report = json.loads((out / "report.json").read_text())
    assert report["status"].startswith("failed: SafetensorError: ") and "File too large" in report["status"]


def _torch_save_size_limit() -> None:
    """``ulimit -f 100`` (100 KiB, as the probe): a bf16 checkpoint's model.safetensors fits, its optimizer.pt
    (written by torch.save) does not."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))


def test_a_file_size_limit_hit_by_torch_save_in_a_checkpoint_is_one_line(workspace, tmp_path):
    """torch.save's writer failing on optimizer.pt (RuntimeError "unexpected pos ..." raised while handling
    "basic_ios::clear: iostream error") was a traceback and exit 1, as full_disk_refused knew only OSError and
    SafetensorError; now the same one line as for safetensors, since a file-size limit is set."""
    run_main(short_taper_argv(workspace, tmp_path / "warm", "--max_steps", "1"))  # the data cache, written unlimited
    out = tmp_path / "run"
    argv = short_taper_argv(workspace, out, "--save_steps", "3", "--dtype", "bf16")
    done = subprocess.run(
        [sys.executable, "-m", "hf_tapernorm.cli", *argv], env=SUBPROCESS_ENV, preexec_fn=_torch_save_size_limit,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert line.startswith(
        f"hf-tapernorm taper: error: --output_dir {out}: its disk could not take what the run writes (RuntimeError: "
    ), line
    assert "unexpected pos" in line and line.endswith(
        "); it kept no complete checkpoint for --resume to continue from: free space (or lift the file-size limit) "
        "and start over with --overwrite, or choose an --output_dir on another disk"
    ), line
    assert (out / "checkpoint-3" / "model.safetensors").is_file()  # the limit was hit after it, in torch.save's file
    assert (out / "checkpoint-3" / "optimizer.pt").stat().st_size == 100 * 1024
    report = json.loads((out / "report.json").read_text())
    assert report["status"].startswith("failed: RuntimeError: ") and "unexpected pos" in report["status"]


def test_a_torch_writer_error_with_room_on_the_disk_and_no_size_limit_passes_unchanged(tmp_path, monkeypatch):
    """Only a full disk or a file-size limit makes torch's writer failure a full disk: the same words with room
    left and no limit are some other fault, and are not renamed."""
    import hf_tapernorm.app.full_disk as full_disk

    monkeypatch.setattr(full_disk.resource, "getrlimit", lambda which: (full_disk.resource.RLIM_INFINITY,) * 2)
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 101632 vs 101524")
    with pytest.raises(RuntimeError) as raised, full_disk.full_disk_refused(tmp_path, "what the run writes"):
        raise error
    assert raised.value is error
    full = SimpleNamespace(free=full_disk.FULL_MARGIN - 1)
    monkeypatch.setattr(full_disk.shutil, "disk_usage", lambda path: full)
    refusal = full_disk.full_disk_refused(tmp_path / "not yet", "what the run writes")
    with (
        pytest.raises(ConfigurationError, match=r"its disk could not take what the run writes \(RuntimeError: "),
        refusal,
    ):
        raise error
    with pytest.raises(RuntimeError, match="mat1 and mat2"), full_disk.full_disk_refused(tmp_path):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")  # not the writer's words: never a full disk


def test_a_disk_that_fills_up_while_tapered_is_written_names_the_checkpoint_resume_continues_from(
    workspace, tmp_path, monkeypatch
):
    """ENOSPC while tapered/ was written (after the Trainer's last checkpoint) was a traceback; now one line that
    names the checkpoint --resume continues from, and the report records the OSError as before."""
    import hf_tapernorm.app.taper as taper

    def full(model, folder, tokenizer=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(taper, "save_tapered", full)
    out = tmp_path / "run"
    line = error_of(short_taper_argv(workspace, out))
    assert line == (
        f"hf-tapernorm taper: error: --output_dir {out}: its disk could not take what the run writes "
        "(OSError: [Errno 28] No space left on device); free space (or lift the file-size limit), then rerun the same "
        f"command with --resume: it continues from the last complete checkpoint, {out / 'checkpoint-6'}"
    ), line
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed: OSError: [Errno 28] No space left on device"
    assert not (out / "tapered").exists() and (out / "checkpoint-6" / "tapernorm_run.json").is_file()


def test_a_full_disk_while_an_export_is_written_is_the_full_disk_line_not_a_temporary_folders(
    workspace, finished, tmp_path, monkeypatch
):
    """ENOSPC while an export's files (its config.json: an OSError, not safetensors' error) were written was refused
    as "could not write the export .E.partial-PID/w: [Errno 28] ...; nothing was written": a hidden temporary folder
    already gone, no word of the disk, and in taper no --resume advice. The file the OSError names (a writer's
    temporary one) is left out of the line. export/writing.py's own refusal is raised from
    the OSError, which full_disk_refused reads: fold's folder and advice, taper's checkpoint to resume from."""
    import hf_tapernorm.export.writing as writing

    def full(folder, model, tokenizer):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "config.json"))

    monkeypatch.setattr(writing, "_write_export", full)
    fold_dir = tmp_path / "fold"
    line = error_of(short_fold_argv(finished / "tapered", fold_dir))
    assert line == (
        f"hf-tapernorm fold: error: --output_dir {fold_dir}: its disk could not take the export (OSError: [Errno 28] "
        "No space left on device); nothing was kept: free space (or lift the file-size limit), or choose an "
        "--output_dir on another disk"
    ), line
    assert not fold_dir.exists()
    out = tmp_path / "run"
    line = error_of(short_taper_argv(workspace, out))
    assert line.startswith(f"hf-tapernorm taper: error: --output_dir {out}: its disk could not take what the run "), (
        line
    )
    assert line.endswith(
        "free space (or lift the file-size limit), then rerun the same command with --resume: it continues from the "
        f"last complete checkpoint, {out / 'checkpoint-6'}"
    ), line


def test_a_full_disk_at_the_run_manifests_first_write_is_the_full_disk_line(workspace, tmp_path, monkeypatch):
    """The run folder's manifest, written before training, was outside the full-disk check: ENOSPC there was a
    traceback (exit 1). It is the same one line, with no checkpoint for --resume to continue from."""
    from hf_tapernorm.app.run_folder import RunFolder

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunFolder, "_write_manifest", full)
    out = tmp_path / "run"
    line = error_of(short_taper_argv(workspace, out))
    assert line == (
        f"hf-tapernorm taper: error: --output_dir {out}: its disk could not take what the run writes (OSError: "
        "[Errno 28] No space left on device); it kept no complete checkpoint for --resume to continue from: free "
        "space (or lift the file-size limit) and start over with --overwrite, or choose an --output_dir on another "
        "disk"
    ), line


def test_a_manifest_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk while the run manifest was written left its half-written .hf_tapernorm_run.json.tmp in the user's
    folder; the write that fails removes it, and the error goes on to the full-disk line."""
    import hf_tapernorm.app.run_folder as run_folder

    folder = run_folder.RunFolder(tmp_path / "run")
    (tmp_path / "run").mkdir()

    def full(source, destination):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_folder.os, "replace", full)
    with pytest.raises(OSError):
        folder._write_manifest({"files": []})
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


# ----------------------------------------------------------------------------- the output folder
def test_resume_without_a_checkpoint_refuses_a_folder_with_files(workspace, tmp_path):
    out = tmp_path / "x"
    (out / "folded").mkdir(parents=True)
    (out / "folded" / "IMPORTANT.txt").write_text("mine")
    (out / "tapered").mkdir()
    (out / "tapered" / "notes.md").write_text("also mine")
    before = snapshot(out)
    message = error_of([*taper_argv(workspace, out), "--resume"])
    assert message.startswith(
        f"hf-tapernorm taper: error: --resume: '{out}' holds no checkpoint of an hf-tapernorm run"
    )
    assert "folded/IMPORTANT.txt" in message and "tapered/notes.md" in message
    assert snapshot(out) == before


def test_overwrite_checks_every_value_before_it_deletes_anything(workspace, finished):
    before = snapshot(finished)
    for flags, expected in (
        (["--scope", "inner"], "argument --scope: invalid choice: 'inner'"),
        (["--ema_rate", "0"], "--ema_rate must be in (0, 1], got 0.0"),
        (["--distill_weight", "-1"], "--distill_weight must be >= 0, got -1.0"),
        (["--scale_loss_weight", "-1"], "--scale_loss_weight must be >= 0, got -1.0"),
        (["--tied_head", "bogus"], "argument --tied_head/--tied-head: invalid choice: 'bogus'"),
        (["--keep_norms", "*norm*"], "nothing would taper in LlamaForCausalLM"),
        (["--block_size", "1000"], "--block_size 1000 exceeds the model's 64 positions"),
        (["--heldout_blocks", "0"], "--heldout_blocks must be positive, got 0"),
        (["--no_such_flag", "1"], "unrecognized arguments: ['--no_such_flag', '1']"),
    ):
        message = error_of([*taper_argv(workspace, finished, steps=8), "--overwrite", *flags])
        assert expected in message, (flags, message)
        assert snapshot(finished) == before, flags


def test_overwrite_replaces_only_a_folder_of_our_own(workspace, finished, tmp_path):
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(finished, copy)
    (copy / "folded" / "IMPORTANT.txt").write_text("a user file inside our export")
    before = snapshot(copy)
    message = error_of([*taper_argv(workspace, copy, steps=8), "--overwrite"])
    assert message == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{copy}': it holds files hf-tapernorm did "
        "not write (folded/IMPORTANT.txt); move them away first"
    )
    assert snapshot(copy) == before
    (copy / "folded" / "IMPORTANT.txt").unlink()
    code, _, stderr = run_main([*taper_argv(workspace, copy, "--distill_weight", "0", steps=8), "--overwrite"])
    assert code == 0, stderr
    assert json.loads((copy / "report.json").read_text())["status"] == "finished"


def test_resume_in_another_precision_is_refused_with_the_flag_that_resumes_it(workspace, finished):
    """taper picks bf16 by itself where it is fast, so a run of another precision may not be the user's doing."""
    trained_in_bf16 = json.loads((finished / "report.json").read_text())["training"]["mixed_precision"] == "bf16"
    before = snapshot(finished)
    other = "false" if trained_in_bf16 else "true"
    message = error_of([*taper_argv(workspace, finished, "--bf16", other, steps=8), "--resume"])
    assert f"training.bf16: {trained_in_bf16} in the run, {not trained_in_bf16} now" in message
    assert f"(--bf16 {str(trained_in_bf16).lower()} resumes it in its own precision)" in message
    assert snapshot(finished) == before


def test_resume_refuses_a_different_run_and_names_what_differs(workspace, finished):
    before = snapshot(finished)
    message = error_of([*taper_argv(workspace, finished, "--distill_weight", "0", steps=9), "--resume"])
    assert message.startswith("hf-tapernorm taper: error: --resume: these options differ from the run in")
    assert "training.max_steps: 8 in the run, 9 now" in message and "--allow_changes" in message
    other_model = error_of(
        [*taper_argv(workspace, finished, "--distill_weight", "0", model="gpt2", steps=8), "--resume"]
    )
    assert "model: " in other_model and "gpt2" in other_model
    assert snapshot(finished) == before
    # A deliberate change is allowed by name and recorded: here one more step at g = 0 (the gate does not move).
    code, _, stderr = run_main(
        [
            *taper_argv(workspace, finished, "--distill_weight", "0", steps=9),
            "--resume",
            "--allow_changes",
            "max_steps,taper_end",
        ]
    )
    assert code == 0, stderr
    report = json.loads((finished / "report.json").read_text())
    assert report["allowed_changes"]["training.max_steps"] == {"run": 8, "now": 9}
    assert report["training"]["steps"] == 9 and report["status"] == "finished"


def test_a_schedule_change_that_moves_the_gate_is_refused_on_resume():
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    for ids in random_batches():
        model(input_ids=ids)
    calibrate(model)
    set_gate(model, TaperSchedule(2, 10).resolve(20).gate(6))  # a checkpoint at step 6 of a 2 -> 10 taper
    controller = TaperController(model, TaperSchedule(2, 16), total_steps=20)
    with pytest.raises(
        TaperStateError,
        match=r"resuming at step 6: model\.layers\.0\.input_layernorm has gate 0\.5000.* "
        r"the schedule changed since the checkpoint was written",
    ):
        controller.check_resume(6)


# ----------------------------------------------------------------------------- one-line errors
def test_fold_refuses_a_checkpoint_above_gate_zero(workspace, tmp_path):
    model = patch_model(AutoModelForCausalLM.from_pretrained(workspace / "llama"), TaperNormConfig.paper()).train()
    for ids in random_batches():
        model(input_ids=ids)
    calibrate(model)
    set_gate(model, 0.5)
    save_tapered(model, tmp_path / "half")
    message = error_of(["fold", "--checkpoint", str(tmp_path / "half"), "--output_dir", str(tmp_path / "out")])
    assert "was saved at gate 0.5: only a model at g = 0 folds" in message
    assert not (tmp_path / "out").exists()


def test_push_without_network_is_one_line(finished, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = error_of(["push", "--export_dir", str(finished / "folded"), "--repo_id", "me/x"])
    assert message.startswith(f"hf-tapernorm push: error: cannot push '{finished / 'folded'}' to me/x:")
    assert "check the network" in message


def test_data_errors_say_what_is_wrong(workspace, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    message = error_of([*taper_argv(workspace, tmp_path / "o"), "--dataset_name", str(empty)])
    assert message == f"hf-tapernorm taper: error: --dataset_name '{empty}' is empty: the file holds no text"


def test_debug_shows_the_traceback(workspace, tmp_path):
    with pytest.raises(ConfigurationError, match="--ema_rate must be in"):
        run_main([*taper_argv(workspace, tmp_path / "o"), "--ema_rate", "0", "--debug"])


@pytest.mark.parametrize(
    ("words", "switched", "debug"),
    [
        (["--debug"], True, []),
        (["--debug", "--max_steps", "3"], True, []),
        (["--debug", "underflow_overflow"], False, ["underflow_overflow"]),
        (["--debug", "underflow_overflow", "tpu_metrics_debug"], False, ["underflow_overflow", "tpu_metrics_debug"]),
        (["--debug", "underflow_overflow tpu_metrics_debug"], False, ["underflow_overflow", "tpu_metrics_debug"]),
        (["--debug", "--debug", "underflow_overflow"], True, ["underflow_overflow"]),
    ],
)
def test_debug_before_a_debug_feature_is_the_trainers_option(workspace, tmp_path, words, switched, debug):
    """The traceback switch took every --debug out of the command line, so the Trainer's --debug underflow_overflow
    (in taper --help) left its value over as an unrecognized argument, refused with a traceback. A --debug followed
    by debug features is the Trainer's option now (a quoted list of them too, as an options file reads it)."""
    from hf_tapernorm._parsing import parse
    from hf_tapernorm.cli.arguments import TaperTrainingArguments
    from hf_tapernorm.cli.main import take_debug_switch

    taken, argv = take_debug_switch(["taper", "--output_dir", str(tmp_path), *words])
    (args,) = parse([TaperTrainingArguments], argv[1:], "hf-tapernorm taper")
    assert taken is switched and [option.value for option in args.debug] == debug


@pytest.mark.parametrize(
    "value", ["underflw_overflow", "UNDERFLOW_OVERFLOW", "underflow_overflow,tpu_metrics_debug", ""]
)
def test_debug_before_a_value_that_is_no_feature_is_the_trainers_option_refused_in_one_line(tmp_path, value):
    """``taper --debug underflw_overflow`` (misspelt, upper case, a comma list, ``""``): the word was no debug feature,
    so --debug was taken as the traceback switch and the value left over was refused as a traceback. After the
    command word, --debug before a value is the Trainer's option now, and its parser names the value in one line."""
    from hf_tapernorm._parsing import UsageError, parse
    from hf_tapernorm.cli.arguments import TaperTrainingArguments
    from hf_tapernorm.cli.main import take_debug_switch

    taken, argv = take_debug_switch(["taper", "--output_dir", str(tmp_path), "--debug", value])
    assert taken is False and argv[-2:] == ["--debug", value]
    with pytest.raises(UsageError) as refused:
        parse([TaperTrainingArguments], argv[1:], "hf-tapernorm taper")
    assert (
        str(refused.value) == f"argument --debug: invalid DebugOption value: {value!r} (see hf-tapernorm taper --help)"
    )


@pytest.mark.parametrize(
    ("argv", "kept"),
    [
        (["--debug", "taper", "--max_steps", "3"], ["taper", "--max_steps", "3"]),
        (["taper", "--debug", "run.yaml"], ["taper", "run.yaml"]),
        (["taper", "--debug", "RUN.YML"], ["taper", "RUN.YML"]),
        (["eval", "--debug", "run.json", "--debug"], ["eval", "run.json"]),
    ],
)
def test_debug_before_the_command_or_an_options_file_is_the_switch(argv, kept):
    """The rule that gives a value after --debug to the Trainer leaves the switch where it was: before the command
    word (``hf-tapernorm --debug taper``), before an options file (``taper --debug run.yaml``) and last."""
    from hf_tapernorm.cli.main import take_debug_switch

    assert take_debug_switch(argv) == (True, kept)


def test_damaged_checkpoints_name_the_file(workspace, finished, tmp_path):
    import shutil

    tapered = tmp_path / "tapered"
    shutil.copytree(finished / "tapered", tapered)
    (tapered / "model.safetensors").write_bytes((tapered / "model.safetensors").read_bytes()[:100])
    with pytest.raises(TaperStateError, match=rf"cannot read {tapered / 'model.safetensors'} \(truncated"):
        load_tapered(tapered)
    folded = tmp_path / "folded"
    shutil.copytree(finished / "folded", folded)
    (folded / "model.safetensors").write_bytes((folded / "model.safetensors").read_bytes()[:100])
    with pytest.raises(OSError, match=r"cannot read the weights in .*folded.*truncated or not a safetensors file"):
        AutoModelForCausalLM.from_pretrained(folded)
    reshaped = tmp_path / "reshaped"
    shutil.copytree(finished / "folded", reshaped)
    state = load_file(reshaped / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(state, reshaped / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=r"has another shape than the folded architecture declares"):
        AutoModelForCausalLM.from_pretrained(reshaped)


# ----------------------------------------------------------------------------- the API edges
def test_patch_model_is_all_or_nothing_and_names_the_module():
    model = build(tiny_llama_config())
    norm = model.model.layers[1].post_attention_layernorm
    model.model.layers[1].post_attention_layernorm = nn.Identity()  # a "norm" nothing can be read from
    with pytest.raises(UnsupportedModelError, match=r"cannot replace 'model\.layers\.1\.post_attention_layernorm'"):
        patch_model(model, TaperNormConfig.paper())
    assert not any(True for _ in tapered_norms(model, include_kept=True))  # nothing was replaced
    model.model.layers[1].post_attention_layernorm = norm
    assert (
        len(list(tapered_norms(patch_model(model, TaperNormConfig.paper()), include_kept=True))) == 5
    )  # a retry is not "already patched"


def test_api_edges():
    assert TaperNormConfig(keep_norms="model.layers.0.input_layernorm").keep_norms == ["model.layers.0.input_layernorm"]
    with pytest.raises(TaperStateError, match="has no TaperNorm layers to calibrate"):
        calibrate(build(tiny_llama_config()))
    with pytest.raises(ConfigurationError, match=r"max_scale_ratio must be > 1, got -1"):
        TaperCallback(max_scale_ratio=-1)
    with pytest.raises(ConfigurationError, match="spike_steps must be an int >= 1"):
        DivergenceThresholds(spike_steps=0)


# ----------------------------------------------------------------------------- the divergence watch
def _controller(thresholds: DivergenceThresholds) -> TaperController:
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.5)).train()
    return TaperController(model, TaperSchedule(1, 40), total_steps=40, thresholds=thresholds)


def test_a_loss_spike_that_persists_stops_the_run_and_a_lone_one_does_not():
    controller = _controller(DivergenceThresholds(spike_ratio=3.0, spike_steps=3, min_history=4))
    losses = [2.0, 2.1, 1.9, 2.2, 2.0, 9.0, 2.1, 2.0, 8.0, 12.0]  # one bad batch at step 6, then a breakdown
    for step, loss in enumerate(losses):
        controller.check(step, loss=loss)
    with pytest.raises(
        TaperDivergenceError,
        match=r"optimizer step 11 .*the training loss has been above 3x its "
        r"running median \(2\) for 3 consecutive steps \(now 40",
    ):
        controller.check(10, loss=40.0)


def test_a_gradient_norm_spike_stops_the_run():
    controller = _controller(DivergenceThresholds(grad_spike_ratio=50.0, spike_steps=2, min_history=3))
    for step, norm in enumerate([3.0, 2.5, 4.0, 3.5]):
        controller.check(step, grad_norm=norm)
    controller.check(4, grad_norm=400.0)
    with pytest.raises(TaperDivergenceError, match=r"the gradient norm has been above 50x its running median"):
        controller.check(5, grad_norm=1e5)


class Explode(TrainerCallback):
    """From optimizer step 6 on, multiplies the head by 4 before each step: the loss climbs, finite, while the
    residual stream (before the head) keeps its scale."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step >= 5:
            with torch.no_grad():
                model.lm_head.weight.mul_(4.0)


def test_the_watch_stops_a_diverging_trainer_run_on_its_loss_before_the_scale_limit(tmp_path):
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.5))
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    watch = DivergenceThresholds(spike_ratio=2.0, spike_steps=2, min_history=3)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[TaperCallback(2, 15, thresholds=watch), Explode()]
    )
    with pytest.raises(TaperDivergenceError) as error:
        trainer.train()
    message = str(error.value)
    assert "running median" in message and "residual scale" not in message
    step = int(message.split("optimizer step ")[1].split(" ")[0])
    assert 6 < step <= 10 and math.isfinite(trainer.state.log_history[-1]["loss"])
