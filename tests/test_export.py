"""export_folded (overwrite protection, model card) and push_to_hub at the huggingface_hub client boundary."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from huggingface_hub import HfApi

from hf_tapernorm import ConfigurationError, TaperStateError, export_folded, fold_model
from hf_tapernorm.export.hub import export_manifest
from tests.helpers import tapered


@pytest.fixture(scope="module")
def folded():
    return fold_model(tapered("gpt2", "all"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_refuses_a_non_empty_folder_without_overwrite(folded, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(
        ConfigurationError, match=rf"{tmp_path} is not empty; choose a new folder or pass overwrite=True"
    ):
        export_folded(folded, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    export_folded(folded, tmp_path, overwrite=True, facts={"base_model": "openai-community/gpt2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hf_tapernorm_export.json",
        "README.md",
        "config.json",
        "folded_sink.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_folded.py",
        "notes.txt",
    ]
    assert export_manifest(tmp_path) == [  # what the export wrote, not the user's notes.txt
        "README.md",
        "config.json",
        "folded_sink.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_folded.py",
    ]
    assert "base_model: openai-community/gpt2" in (tmp_path / "README.md").read_text()
    with pytest.raises(ConfigurationError, match="it is a file"):
        export_folded(folded, tmp_path / "notes.txt")


def test_export_refuses_an_unfolded_model(tmp_path):
    model = tapered("llama")
    with pytest.raises(
        TaperStateError, match="export_folded expects a folded model from fold_model, got LlamaForCausalLM"
    ):
        export_folded(model, tmp_path / "out")


def test_push_to_hub_uploads_exactly_the_export(folded, tmp_path):
    facts = {"base_model": "openai-community/gpt2", "repo_id": "me/gpt2-normfree", "license": "mit"}
    local = _files(export_folded(folded, tmp_path / "local", facts=facts))  # attaches the card to the model
    del local[".hf_tapernorm_export.json"]  # the export's own list of its files, not a file of the model
    uploaded = {}

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploaded.update(repo_id=repo_id, files=_files(Path(folder_path)), **kwargs)
        return "commit-info"

    create_repo = mock.Mock(return_value=SimpleNamespace(repo_id="me/gpt2-normfree"))
    with mock.patch.object(HfApi, "create_repo", create_repo), mock.patch.object(HfApi, "upload_folder", upload_folder):
        result = folded.push_to_hub("me/gpt2-normfree", private=True, commit_message="norm-free GPT-2")
    assert result == "commit-info"
    create_repo.assert_called_once_with("me/gpt2-normfree", private=True, exist_ok=True, repo_type="model")
    assert uploaded["repo_id"] == "me/gpt2-normfree" and uploaded["commit_message"] == "norm-free GPT-2"
    assert uploaded["create_pr"] is False and uploaded["revision"] is None
    assert (
        sorted(uploaded["files"])
        == sorted(local)
        == [
            "README.md",
            "config.json",
            "folded_sink.py",
            "generation_config.json",
            "model.safetensors",
            "modeling_folded.py",
        ]
    )
    for name, content in local.items():
        assert uploaded["files"][name] == content, name
    assert "base_model: openai-community/gpt2" in uploaded["files"]["README.md"].decode()


@pytest.mark.parametrize("first", ["hf_tapernorm", "transformers"])
def test_an_export_loads_through_the_auto_classes_in_a_fresh_process(folded, tmp_path, first):
    """``import hf_tapernorm`` registers the folded types lazily, whichever of the two is imported first."""
    import os
    import subprocess
    import sys

    folder = export_folded(folded, tmp_path / "out")
    imports = {
        "hf_tapernorm": "import hf_tapernorm\nfrom transformers import AutoModelForCausalLM",
        "transformers": "from transformers import AutoModelForCausalLM\nimport hf_tapernorm",
    }[first]
    code = f"{imports}\nmodel = AutoModelForCausalLM.from_pretrained({str(folder)!r})\nprint(type(model).__name__)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == type(folded).__name__
