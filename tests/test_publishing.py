"""Publishing an export: ``push`` uploads only the files the export wrote, and only with the weights its model card
and robustness scan were written with (the manifest records their sha256).

The Hub is never reached: ``HfApi`` is replaced by a stand-in that records what would be uploaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tapernorm import save_tapered
from hf_tapernorm.export.hub import EXPORT_MANIFEST_NAME, WEIGHTS_KEY, recording_export
from tests.conftest import char_tokenizer
from tests.helpers import error_of, run_main, tapered

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


@pytest.fixture
def hub(monkeypatch) -> list:
    """The uploads push makes (one entry per upload_folder call)."""
    import huggingface_hub

    uploads: list = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id)
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: uploads.append(kw))
    return uploads


def push(folder: Path) -> list[str]:
    return ["push", "--export_dir", str(folder), "--repo_id", "me/tiny-normfree"]


def copy_of(export: Path, tmp_path: Path) -> Path:
    shutil.copytree(export, tmp_path / "folded")
    return tmp_path / "folded"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def changed_weights_error(folder: Path) -> str:
    return (
        f"hf-tapernorm push: error: '{folder}': model.safetensors changed after the export wrote its model card and "
        f"robustness scan (its sha256 is not the one {EXPORT_MANIFEST_NAME} recorded: edited, or a model saved over "
        "the export), so README.md and the scan describe other weights; write a fresh export with hf-tapernorm fold "
        "--overwrite from the tapered checkpoint, whose card and scan are of its weights (weights changed on purpose "
        "need a card of their own: hf-tapernorm eval --scan_reference measures them)"
    )


def test_the_export_records_the_digest_of_the_weights_its_card_describes(export):
    manifest = json.loads((export / EXPORT_MANIFEST_NAME).read_text())
    assert manifest[WEIGHTS_KEY] == {"model.safetensors": sha256(export / "model.safetensors")}


def test_push_refuses_weights_edited_after_the_export(export, tmp_path, hub):
    """The edited weights were uploaded under the card and scan of the exported ones ('no broken window')."""
    folder = copy_of(export, tmp_path)
    with recording_export(folder):  # the scan an export of a run folder holds (what push shows)
        (folder / "robustness_scan.json").write_text(json.dumps(SCAN))
    assert run_main(push(folder))[0] == 0 and len(hub) == 1
    hub.clear()
    weights = load_file(str(folder / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] * 1.5
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, stdout, stderr = run_main(push(folder))
    assert code == 2 and stderr.strip().splitlines()[-1] == changed_weights_error(folder), stderr
    assert hub == [] and "robustness scan" not in stdout  # nothing uploaded, no scan announced for these weights


def test_push_refuses_a_model_fine_tuned_and_saved_over_its_export(export, tmp_path, hub):
    tapered_dir = export.parent / "tapered"
    folder = copy_of(export, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # a fine-tuning step
    model.save_pretrained(folder)
    assert error_of(push(folder)) == changed_weights_error(folder)
    assert hub == []
    code, _, stderr = run_main(fold(tapered_dir, folder, "--overwrite"))  # what the message says to do
    assert code == 0, stderr
    code, _, stderr = run_main(push(folder))
    assert code == 0, stderr
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    assert len(hub) == 1 and manifest[WEIGHTS_KEY] == {"model.safetensors": sha256(folder / "model.safetensors")}


def test_an_export_of_an_earlier_version_is_pushed_with_a_warning(export, tmp_path, hub, caplog):
    """Its manifest recorded no digest: push cannot check the card against the weights, and says so."""
    folder = copy_of(export, tmp_path)
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    del manifest[WEIGHTS_KEY]
    (folder / EXPORT_MANIFEST_NAME).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        code, _, stderr = run_main(push(folder))
    assert code == 0, stderr
    assert "recorded no digest of its weights: push cannot check" in caplog.text and len(hub) == 1


def test_a_manifest_whose_digests_were_edited_is_refused(export, tmp_path, hub):
    folder = copy_of(export, tmp_path)
    manifest = json.loads((folder / EXPORT_MANIFEST_NAME).read_text())
    manifest[WEIGHTS_KEY] = {"../model.safetensors": "0" * 64}
    (folder / EXPORT_MANIFEST_NAME).write_text(json.dumps(manifest))
    assert error_of(push(folder)) == (
        f"hf-tapernorm push: error: the export manifest {folder / EXPORT_MANIFEST_NAME} is damaged or was edited; "
        "re-export the model"
    )
    assert hub == []
