"""Publishing an export: ``push`` uploads only the files the export wrote, and only as its model card and robustness
scan were written with them (the manifest records every file's sha256); never while a command writes the folder,
never a command's lock; to a repository named with or without its owner.

The Hub is never reached: ``HfApi`` is replaced by a stand-in that records what would be uploaded.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tapernorm import save_tapered
from hf_tapernorm.app.run_lock import LOCK_NAME, process_start_time
from hf_tapernorm.export.manifest import DIGESTS_KEY, EXPORT_MANIFEST_NAME, recording_export
from tests.conftest import char_tokenizer
from tests.helpers import edit_json, error_of, run_main, tapered

SCAN = {"broken": 0, "windows": 8, "rows": []}


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A folded export written by ``fold`` from a tapered tiny Llama."""
    root = tmp_path_factory.mktemp("publishing")
    save_tapered(tapered("llama"), root / "tapered", char_tokenizer())
    code, _, stderr = run_main(fold(root / "tapered", root / "folded"))
    assert code == 0, stderr
    return root / "folded"


def fold(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(out), "--scan_windows", "0", *extra]


def push(folder: Path) -> list[str]:
    return ["push", "--export_dir", str(folder), "--repo_id", "me/tiny-normfree"]


def copy_of(export: Path, tmp_path: Path) -> Path:
    shutil.copytree(export, tmp_path / "folded")
    return tmp_path / "folded"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def changed_error(folder: Path, name: str = "model.safetensors") -> str:
    return (
        f"hf-tapernorm push: error: '{folder}': {name} changed after the export wrote it (the sha256 "
        f"{EXPORT_MANIFEST_NAME} recorded differs: edited, or a model saved over the export), so the upload would "
        "not be the model its README.md and robustness scan describe; write a fresh export with hf-tapernorm fold "
        "--overwrite from the tapered checkpoint, whose card and scan are of its files (weights changed on purpose "
        "need a card of their own: hf-tapernorm eval --scan_reference measures them)"
    )


def test_the_export_records_the_digest_of_every_file_it_wrote(export):
    manifest = json.loads((export / EXPORT_MANIFEST_NAME).read_text())
    assert {"model.safetensors", "config.json", "modeling_folded.py", "README.md"} <= set(manifest["files"])
    assert manifest[DIGESTS_KEY] == {name: sha256(export / name) for name in manifest["files"]}


def test_push_refuses_weights_edited_after_the_export(export, tmp_path, hub):
    """The edited weights were uploaded under the card and scan of the exported ones ('no broken window')."""
    folder = copy_of(export, tmp_path)
    with recording_export(folder):  # the scan an export of a run folder holds (what push shows)
        (folder / "robustness_scan.json").write_text(json.dumps(SCAN))
    assert run_main(push(folder))[0] == 0 and len(hub.uploads) == 1
    hub.uploads.clear()
    weights = load_file(str(folder / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, stdout, stderr = run_main(push(folder))
    assert code == 2 and stderr.strip().splitlines()[-1] == changed_error(folder), stderr
    assert (
        hub.uploads == [] and "robustness scan" not in stdout
    )  # nothing uploaded, no scan announced for these weights


def test_push_refuses_a_model_fine_tuned_and_saved_over_its_export(export, tmp_path, hub):
    tapered_dir = export.parent / "tapered"
    folder = copy_of(export, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # a fine-tuning step
    model.save_pretrained(folder)
    assert error_of(push(folder)) == changed_error(folder)
    assert hub.uploads == []
    code, _, stderr = run_main(fold(tapered_dir, folder, "--overwrite"))  # what the message says to do
    assert code == 0, stderr
    code, _, stderr = run_main(push(folder))
    assert code == 0, stderr
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    assert len(hub.uploads) == 1 and manifest[DIGESTS_KEY]["model.safetensors"] == sha256(folder / "model.safetensors")


def test_an_export_of_an_earlier_version_is_pushed_with_a_warning(export, tmp_path, hub, caplog):
    """Its manifest recorded no digest: push cannot check the card against the files, and says so."""
    folder = copy_of(export, tmp_path)
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    del manifest[DIGESTS_KEY]
    (folder / EXPORT_MANIFEST_NAME).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        code, _, stderr = run_main(push(folder))
    assert code == 0, stderr
    assert "recorded no digest of its files: push cannot check" in caplog.text and len(hub.uploads) == 1


def test_a_manifest_whose_digests_were_edited_is_refused(export, tmp_path, hub):
    folder = copy_of(export, tmp_path)
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    manifest[DIGESTS_KEY] = {"../model.safetensors": "0" * 64}
    (folder / EXPORT_MANIFEST_NAME).write_text(json.dumps(manifest))
    assert error_of(push(folder)) == (
        f"hf-tapernorm push: error: the export manifest {folder / EXPORT_MANIFEST_NAME} is damaged or was edited; "
        "re-export the model"
    )
    assert hub.uploads == []


# ============================================================================= every file the export wrote
def _edit_code(folder: Path) -> None:
    path = folder / "modeling_folded.py"
    path.write_text(path.read_text() + "\nEDITED = True\n")


#: name -> an edit made after the export, by hand (not by a writer of the export)
EDITS = {
    "config.json": lambda folder: edit_json(folder / "config.json", rms_norm_eps=1e-3),
    "modeling_folded.py": _edit_code,
    "robustness_scan.json": lambda folder: edit_json(folder / "robustness_scan.json", broken=0),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_push_refuses_any_file_of_the_export_edited_after_it(export, tmp_path, hub, name):
    """Only the weights were checked: an edited config, modeling code, or a scan edited to "broken": 0 was uploaded
    under the card and scan of the export."""
    folder = copy_of(export, tmp_path)
    with recording_export(folder):  # the scan's writer records the file's digest: it may rewrite it
        (folder / "robustness_scan.json").write_text(json.dumps({**SCAN, "broken": 3}))
    EDITS[name](folder)
    code, stdout, stderr = run_main(push(folder))
    assert code == 2 and stderr.strip().splitlines()[-1] == changed_error(folder, name), stderr
    assert hub.uploads == [] and "robustness scan" not in stdout


# ============================================================================= a folder a command writes
def _live_lock(folder: Path) -> None:
    """The lock of a live hf-tapernorm command (this process: alive, on this host, with its start time)."""
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": process_start_time(os.getpid())}
    (folder / LOCK_NAME).write_text(json.dumps(owner))


def test_push_refuses_an_export_a_running_command_owns(export, tmp_path, hub):
    """A taper or fold writing the export (its lock in the export folder or the run folder around it): push
    uploaded the folder as it was at that moment, without a word."""
    folder = copy_of(export, tmp_path)
    _live_lock(folder)
    message = error_of(push(folder))
    assert message.startswith(f"hf-tapernorm push: error: --export_dir '{folder}' is in use: a running "), message
    assert "wait for it to finish" in message
    (folder / LOCK_NAME).unlink()
    _live_lock(tmp_path)  # the run folder around the export
    assert f"lies in '{tmp_path}', which a running hf-tapernorm command owns" in error_of(push(folder))
    link = tmp_path.parent / f"{tmp_path.name}-link"  # a link to the export, outside the held run folder
    link.symlink_to(folder)
    assert "which a running hf-tapernorm command owns" in error_of(push(link))  # the link was not followed
    assert hub.uploads == []


def test_push_never_uploads_a_lock_file(export, tmp_path, hub):
    """push's advice for a stale lock left in the folder was --include .hf_tapernorm_run.lock, which uploaded it
    (a pid and a host name)."""
    folder = copy_of(export, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    for extra in ([], ["--include", LOCK_NAME], ["--include", "*"]):
        code, _, stderr = run_main([*push(folder), *extra])
        assert code == 0, stderr
        patterns = hub.uploads.pop()["allow_patterns"]
        assert not any(fnmatch.fnmatchcase(LOCK_NAME, p) for p in patterns), patterns
        assert any(fnmatch.fnmatchcase("model.safetensors", p) for p in patterns), patterns


# ============================================================================= the repository
def test_push_to_a_name_without_an_owner_goes_under_the_token_s_user(export, tmp_path, hub, caplog):
    """It was refused: "--repo_id must look like 'owner/name'"; the Hub puts a bare name under the token's user."""
    with caplog.at_level(logging.INFO):
        code, stdout, stderr = run_main(["push", "--export_dir", str(export), "--repo_id", "tiny-normfree"])
    assert code == 0, stderr
    assert [upload["repo_id"] for upload in hub.uploads] == ["me/tiny-normfree"]
    assert "repo id tiny-normfree names no owner: the Hub puts it under the token's user, as me/tiny-normfree" in (
        caplog.text
    )


def test_a_commit_message_with_a_body_is_the_commit_s_summary_and_description(export, tmp_path, hub):
    """`--commit_message $'Title\\n\\nBody'` was refused as holding "a line break, which a path or name cannot hold":
    a commit message is no path, and a body is valid git. Its first line is the Hub commit's summary, the rest its
    description; a one-line message has none. Paths keep the rule."""
    message = "Fold the tiny model\r\n\nTapered 6 steps;\nsee the card."
    code, _, stderr = run_main([*push(export), "--commit_message", message])
    assert code == 0, stderr
    (upload,) = hub.uploads
    assert (upload["commit_message"], upload["commit_description"]) == (
        "Fold the tiny model",
        "Tapered 6 steps;\nsee the card.",
    )
    code, _, stderr = run_main([*push(export), "--commit_message", "One line"])
    assert code == 0, stderr
    assert (hub.uploads[-1]["commit_message"], hub.uploads[-1]["commit_description"]) == ("One line", None)
    assert "holds a line break" in error_of(["push", "--export_dir", f"{export}\n", "--repo_id", "me/x"])


def test_a_commit_message_loses_its_blank_edges_as_in_git_and_one_without_text_is_refused(export, tmp_path, hub):
    """`--commit_message $'\\nMy title\\nmore'` made the library's default title the summary and the user's title
    part of the description; `--commit_message ''` got that default without a word. Blank lines around a message
    are stripped, as git strips them, and a message with no text is refused before anything is uploaded."""
    code, _, stderr = run_main([*push(export), "--commit_message", "\n \r\nMy title\nmore\n\n"])
    assert code == 0, stderr
    assert [(u["commit_message"], u["commit_description"]) for u in hub.uploads] == [("My title", "more")]
    for empty in ("", "\n \n"):
        assert error_of([*push(export), "--commit_message", empty]) == (
            f"hf-tapernorm push: error: --commit_message {empty!r} holds no text: write a title (a body may follow a "
            "line break), or leave the option out for the default"
        )
    assert len(hub.uploads) == 1
