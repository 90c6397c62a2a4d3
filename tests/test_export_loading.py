"""An export loaded as its plain base class (config.json's ``model_type`` edited, to load without remote code) is
refused at load: as a plain Llama it would drop its stored sink and run its folded norms as norms of ones.

The refusal is raised on transformers' load report, which transformers logs while its warnings are on (its default;
TransformerLens turns them off for the whole process when imported, so the tests that need them set them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.errors import ConfigurationError
from tests.conftest import char_tokenizer
from tests.helpers import REPO, error_of, tapered

REFUSAL = (
    r"LlamaForCausalLM: '{folder}' is a folded export whose config.json names model_type 'llama' instead of "
    r"'tapernorm_llama'; loaded as a plain model it runs its folded norms as norms of ones and drops its stored "
    r"sink, so its logits are not the export's. Restore \"model_type\": \"tapernorm_llama\" and load it where "
    r"hf_tapernorm is imported, or with trust_remote_code=True"
)


@pytest.fixture
def warnings_on():
    """transformers' warnings at their default level (another test's import of TransformerLens turns them off)."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()
    yield
    transformers_logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """A Llama sink export whose config.json names ``model_type: llama``."""
    folder = tmp_path_factory.mktemp("edited") / "export"
    export_folded(fold_model(tapered("llama", sink_token_ids=[5])), folder, tokenizer=char_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}, indent=2))
    return folder


def test_automodel_refuses_an_export_edited_to_its_base_model_type(edited, warnings_on):
    with pytest.raises(OSError, match=REFUSAL.format(folder=edited)):
        AutoModelForCausalLM.from_pretrained(edited)


def test_the_refusal_needs_only_hf_tapernorm_imported(edited):
    """In a fresh interpreter that has made no export: importing hf_tapernorm is enough."""
    code = (
        "import hf_tapernorm\nfrom transformers import AutoModelForCausalLM\n"
        f"try:\n    AutoModelForCausalLM.from_pretrained({str(edited)!r})\n"
        "except OSError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "is a folded export whose config.json names model_type 'llama'" in done.stdout, done.stderr[-2000:]


def test_load_export_refuses_it_when_transformers_reports_nothing(edited):
    """With transformers' warnings off there is no load report to refuse at; the integrations refuse the model."""
    from hf_tapernorm.integrations.exports import load_export

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(edited)
    finally:
        transformers_logging.set_verbosity(verbosity)
    with pytest.raises(ConfigurationError, match=REFUSAL.format(folder=edited)):
        load_export(model)


def test_eval_refuses_it_in_one_line(edited, workspace, warnings_on):
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--scan_windows", "0"]
    message = error_of(["eval", "--model_name_or_path", str(edited), *data])
    assert message.startswith("hf-tapernorm eval: error: ") and 'Restore "model_type": "tapernorm_llama"' in message


def test_eval_refuses_it_in_one_line_with_transformers_warnings_off(edited, workspace):
    """The CLI's own model loading names the cause whatever transformers' log level (TransformerLens, once imported,
    sets it to errors only for the whole process)."""
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--scan_windows", "0"]
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        message = error_of(["eval", "--model_name_or_path", str(edited), *data])
    finally:
        transformers_logging.set_verbosity(verbosity)
    assert message.startswith("hf-tapernorm eval: error: ") and 'Restore "model_type": "tapernorm_llama"' in message
