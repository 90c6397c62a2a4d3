"""The hostile probe, round 2 (issue 34): odd paths, odd data, edited run folders, library misuse, export loading
and push, each with the right result or one clear early error (conversion_scripts/experiments/reports/probe.md,
"Fresh probe, round 2", lists every case with its outcome before and after).

Tiny models only (hidden 32, 2 layers); one finished 6-step run is shared by the cases that edit a run folder
(each edits its own copy). The Hub is never reached: push runs against a stand-in ``HfApi`` that applies the
same ``allow_patterns`` filter as ``upload_folder``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from hf_tapernorm import (
    CalibrationError,
    ConfigurationError,
    TaperCallback,
    TaperController,
    TaperNormConfig,
    TaperStateError,
    UnsupportedModelError,
    export_folded,
    fold_model,
    load_tapered,
    patch_model,
    save_tapered,
)
from hf_tapernorm.app.training_run import IDENTITY_NAME
from hf_tapernorm.data.corpus import load_text_dataset
from hf_tapernorm.export.hub import files_to_push
from hf_tapernorm.layers import set_gate
from tests.conftest import build, char_tokenizer, corpus_documents, random_batches, save_tiny_model, tiny_llama_config
from tests.helpers import IDS, logits, relative_error, run_main, snapshot, tapered


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe2")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


def taper(ws: Path, out, *extra: str, data: str = "corpus.txt", model: str | None = None) -> list[str]:
    return [
        "taper", "--model_name_or_path", model or str(ws / "llama"), "--dataset_name", str(ws / data),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "6",
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "4", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(ws / "cache"), "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", *extra,
    ]  # fmt: skip


def evaluate(model: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [
        "eval", "--model_name_or_path", str(model), "--dataset_name", str(data or model.parent.parent / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--out_of_corpus_blocks", "0", "--scan_windows", "0", *extra,
    ]  # fmt: skip


def fold(checkpoint: Path, output_dir, *extra: str) -> list[str]:
    return ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(output_dir), "--scan_windows", "0", *extra]


@pytest.fixture(scope="module")
def run(ws) -> Path:
    """A finished 6-step run (checkpoint-6, tapered/, folded/, report.json); cases edit copies of it."""
    out = ws / "run"
    code, _, stderr = run_main(taper(ws, out))
    assert code == 0, stderr
    return out


def copy_of(run: Path, tmp_path: Path, name: str = "run") -> Path:
    target = tmp_path / name
    shutil.copytree(run, target, symlinks=True)
    return target


def edit_json(path: Path, **values) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def truncate(path: Path, keep: int = 30) -> None:
    path.write_text(path.read_text()[:keep])


def error_line(argv: list[str]) -> str:
    code, _, stderr = run_main(argv)
    lines = [line for line in stderr.strip().splitlines() if line.startswith("hf-tapernorm")]
    assert code == 2 and lines and ": error: " in lines[-1], stderr[-2000:]
    return lines[-1]


# ============================================================================= CLI refusals (one line, exit 2)
def _options_with_a_flag(ws, run, tmp):
    (tmp / "run.yaml").write_text(yaml.safe_dump({"max_steps": 6, "output_dir": str(tmp / "out")}))
    return ["taper", str(tmp / "run.yaml"), "--max_steps", "4"]


def _overwrite_damaged_manifest(ws, run, tmp):
    folder = copy_of(run, tmp)
    truncate(folder / ".hf_tapernorm_run.json", 50)
    return taper(ws, folder, "--overwrite")


def _eval_folded_config_float(ws, run, tmp):
    folder = copy_of(run, tmp)
    edit_json(folder / "folded" / "config.json", hidden_size=32.0)
    return evaluate(folder / "folded", data=ws / "corpus.txt")


def _edited_tapered(command, edit):
    """eval or fold of a copy of the run whose tapered/ folder ``edit`` changed."""

    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        edit(folder / "tapered")
        if command == "eval":
            return evaluate(folder / "tapered", data=ws / "corpus.txt")
        return fold(folder / "tapered", tmp / "export")

    return make


def _tapered_config_string(command):
    return _edited_tapered(command, lambda tapered: edit_json(tapered / "config.json", num_hidden_layers="2"))


def _truncated_tapernorm_config(command):
    return _edited_tapered(command, lambda tapered: truncate(tapered / "tapernorm_config.json"))


def _edited_manifest(entry):
    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        manifest = folder / "folded" / ".hf_tapernorm_export.json"
        files = json.loads(manifest.read_text())["files"]
        manifest.write_text(json.dumps({"tool": "hf-tapernorm", "files": [*files, entry]}))
        return ["push", "--export_dir", str(folder / "folded"), "--repo_id", "me/x"]

    return make


def _push_with(relative: str):
    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        (folder / "folded" / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / "folded" / relative).write_text("hf_not_a_real_token")
        return ["push", "--export_dir", str(folder / "folded"), "--repo_id", "me/x"]

    return make


def _resume_with_edited_checkpoint_config(ws, run, tmp):
    folder = copy_of(run, tmp)
    edit_json(folder / "checkpoint-6" / "tapernorm_config.json", ema_rate=0.5)
    return taper(ws, folder, "--resume")


def _data(name: str, text: str):
    def make(ws, run, tmp):
        (tmp / name).write_text(text)
        return taper(ws, tmp / "out", data=str(tmp / name))

    return make


#: name -> (argv builder (ws, finished run, tmp_path), fragments of the one-line error)
REFUSALS = {
    "options file followed by a flag": (_options_with_a_flag, ["run.yaml is read alone", "put --max_steps"]),
    "repo id with a space": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "folded"), "--repo_id", "me/has space"],
        ["--repo_id 'me/has space' is not a valid Hub repository name"],
    ),
    "repo id with '..'": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "folded"), "--repo_id", "me/a..b"],
        ["not a valid Hub repository name"],
    ),
    "fold into a folder inside the checkpoint": (
        lambda ws, run, tmp: fold(copy_of(run, tmp) / "tapered", tmp / "run" / "tapered" / "sub"),
        ["lies inside --checkpoint", "choose a folder outside the checkpoint"],
    ),
    "overwrite of a run whose manifest is damaged": (
        _overwrite_damaged_manifest,
        ["manifest .hf_tapernorm_run.json is unreadable", "--resume rebuilds it"],
    ),
    "eval of an export whose config has hidden_size 32.0": (
        _eval_folded_config_float,
        ["cannot read the config of", "hidden_size"],
    ),
    "eval of a tapered checkpoint whose config has a string layer count": (
        _tapered_config_string("eval"),
        ["cannot read the config of tapered checkpoint", "num_hidden_layers"],
    ),
    "fold of a tapered checkpoint whose config has a string layer count": (
        _tapered_config_string("fold"),
        ["cannot read the config of tapered checkpoint", "num_hidden_layers"],
    ),
    "eval of a truncated tapernorm_config.json": (
        _truncated_tapernorm_config("eval"),
        ["cannot read", "tapernorm_config.json"],
    ),
    "fold of a truncated tapernorm_config.json": (
        _truncated_tapernorm_config("fold"),
        ["cannot read", "tapernorm_config.json"],
    ),
    "eval of the run folder itself": (
        lambda ws, run, tmp: evaluate(run, data=ws / "corpus.txt"),
        ["folder without config.json"],
    ),
    "fold of the run folder itself": (lambda ws, run, tmp: fold(run, tmp / "x"), ["folder without config.json"]),
    "fold --overwrite onto the run folder": (
        lambda ws, run, tmp: fold(copy_of(run, tmp) / "tapered", tmp / "run", "--overwrite"),
        ["refusing to --overwrite", "not an earlier export"],
    ),
    "eval --output_json naming a folder": (
        lambda ws, run, tmp: evaluate(run / "folded", "--output_json", str(tmp), data=ws / "corpus.txt"),
        ["is a symbolic link or a folder; name a new file"],
    ),
    "eval --scan_reference missing": (
        lambda ws, run, tmp: (
            [*evaluate(run / "folded", data=ws / "corpus.txt")[:-2], "--scan_windows", "4"]
            + ["--scan_reference", str(tmp / "nope")]
        ),
        ["nope' not found"],
    ),
    "eval --sink none of a sink-trained export": (
        lambda ws, run, tmp: evaluate(run / "folded", "--sink", "none", data=ws / "corpus.txt"),
        ["was trained with the sink [127]", "--sink auto"],
    ),
    "push of tapered/": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "tapered"), "--repo_id", "me/x"],
        ["is not a folded export"],
    ),
    "push of the run folder": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run), "--repo_id", "me/x"],
        ["folder without config.json"],
    ),
    "push of a manifest edited to name ../report.json": (
        _edited_manifest("../report.json"),
        ["is damaged or was edited"],
    ),
    "push of a manifest edited to name '*'": (_edited_manifest("*"), ["lacks files of its export (*)"]),
    "push with a hidden .cache/token": (_push_with(".cache/token"), ["did not write (.cache/token)", "--include"]),
    "push with a file named like a pattern": (_push_with("[tokenizer].json"), ["did not write ([tokenizer].json)"]),
    "resume after editing the checkpoint's tapernorm_config.json": (
        _resume_with_edited_checkpoint_config,
        ["tapernorm_config.json was edited after the run wrote it", "ema_rate: 0.5 in the file, 0.01 recorded"],
    ),
    "data of blank lines only": (_data("blank.txt", "\n\n   \n\t\n\n"), ["blank.txt' is too small"]),
    "data of one huge line": (
        _data("line.txt", " ".join(corpus_documents(150))),
        ["holds only 1 document(s)", "--sample_by line"],
    ),
    "scan_windows -1": (lambda ws, run, tmp: taper(ws, tmp / "o", "--scan_windows", "-1"), ["--scan_windows"]),
    "out_of_corpus_blocks -1": (
        lambda ws, run, tmp: taper(ws, tmp / "o", "--out_of_corpus_blocks", "-1"),
        ["--out_of_corpus_blocks must be >= 0"],
    ),
    "heldout_percentage 0": (
        lambda ws, run, tmp: taper(ws, tmp / "o", "--heldout_percentage", "0"),
        ["--heldout_percentage must be in (0, 100)"],
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_cli_case_is_refused_in_one_line_and_changes_nothing(ws, run, tmp_path, name):
    make_argv, fragments = REFUSALS[name]
    argv = make_argv(ws, run, tmp_path)
    before, run_before = snapshot(tmp_path), snapshot(run)
    line = error_line(argv)
    for fragment in fragments:
        assert fragment in line, line
    assert snapshot(tmp_path) == before and snapshot(run) == run_before


# ============================================================================= library refusals
def _llama(**overrides):
    return build(tiny_llama_config(**overrides))


def _paper(**overrides):
    return patch_model(_llama(), TaperNormConfig.paper(**overrides))


def _loaded_export(kind: str, tmp: Path):
    folder = export_folded(fold_model(tapered(kind)), tmp / f"{kind}_export")
    return AutoModelForCausalLM.from_pretrained(folder)


def _export_over_a_model(tmp: Path):
    save_tiny_model(tmp / "my_model")
    return export_folded(fold_model(tapered("llama")), tmp / "my_model", overwrite=True)


def _export_under_a_file(tmp: Path):
    (tmp / "afile").write_text("x")
    return export_folded(fold_model(tapered("llama")), tmp / "afile" / "sub")


def _controller_loop(train: bool):
    model = _paper(taper_start=2, taper_end=4).train(train)
    controller = TaperController(model, total_steps=6)
    for step in range(6):
        controller.step_begin(step)
        ids = random_batches(n=1, seed=step)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(step)


def _trainer_with_reversed_window(tmp: Path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp / "t"), max_steps=6, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=_paper(), args=args, callbacks=[TaperCallback(taper_start=0.8, taper_end=0.2)])


#: name -> (call (tmp_path), error type, fragment of its message)
LIBRARY_REFUSALS = {
    "fold_model(tolerance=True)": (
        lambda tmp: fold_model(tapered("llama"), tolerance=True),
        ConfigurationError,
        "tolerance must be a positive finite number, got True",
    ),
    "fold_model(tolerance='1e-3')": (
        lambda tmp: fold_model(tapered("llama"), tolerance="1e-3"),
        ConfigurationError,
        "got '1e-3'",
    ),
    "fold_model of a loaded llama export": (
        lambda tmp: fold_model(_loaded_export("llama", tmp)),
        TaperStateError,
        "is already folded (a norm-free export)",
    ),
    "fold_model of a loaded gpt2 export": (
        lambda tmp: fold_model(_loaded_export("gpt2", tmp)),
        TaperStateError,
        "is already folded",
    ),
    "patch_model of a loaded export": (
        lambda tmp: patch_model(_loaded_export("llama", tmp), TaperNormConfig.paper()),
        TaperStateError,
        "is a folded export (tapernorm_llama): its norms are folded away already",
    ),
    "fold_model of torch.compile's wrapper": (
        lambda tmp: fold_model(torch.compile(tapered("llama"))),
        UnsupportedModelError,
        "fold_model(model._orig_mod)",
    ),
    "fold_model of the base LlamaModel": (
        lambda tmp: fold_model(tapered("llama").model),
        UnsupportedModelError,
        "expects a LlamaForCausalLM, got LlamaModel",
    ),
    "fold_model probe beyond the vocabulary": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.randint(200, 300, (1, 5))),
        ConfigurationError,
        "probe must be a (batch, tokens) tensor of token ids in [0, 128)",
    ),
    "fold_model float probe": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.rand(1, 5)),
        ConfigurationError,
        "torch.float32",
    ),
    "fold_model 1-D probe": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.arange(5)),
        ConfigurationError,
        "got (5,)",
    ),
    "export_folded under a file": (_export_under_a_file, ConfigurationError, "afile is a file"),
    "export_folded overwrite=True onto an original model": (
        _export_over_a_model,
        ConfigurationError,
        "refusing overwrite=True",
    ),
    "export_folded facts as a list": (
        lambda tmp: export_folded(fold_model(tapered("llama")), tmp / "e", facts=["x"]),
        ConfigurationError,
        "facts= must be a mapping",
    ),
    "scale_loss_weight inf": (
        lambda tmp: TaperNormConfig(scale_loss_weight=float("inf")),
        ConfigurationError,
        "scale_loss_weight must be a finite number",
    ),
    "distill_weight inf": (
        lambda tmp: TaperNormConfig(distill_weight=float("inf")),
        ConfigurationError,
        "distill_weight must be a finite number",
    ),
    "calibration_scale inf": (
        lambda tmp: TaperNormConfig(calibration_scale=float("inf")),
        ConfigurationError,
        "calibration_scale must be a finite number",
    ),
    "distill_weight nan": (
        lambda tmp: TaperNormConfig(distill_weight=float("nan")),
        ConfigurationError,
        "distill_weight must be >= 0",
    ),
    "sink id -1": (lambda tmp: TaperNormConfig(sink_token_ids=[-1]), ConfigurationError, "must be non-negative"),
    "for_model with a tokenizer name": (
        lambda tmp: TaperNormConfig.for_model(_llama(), tokenizer="gpt2"),
        ConfigurationError,
        "got the name 'gpt2': pass AutoTokenizer.from_pretrained(name)",
    ),
    "patch_model with a tokenizer name": (
        lambda tmp: patch_model(_llama(), tokenizer="gpt2"),
        ConfigurationError,
        "tokenizer= must be a tokenizer",
    ),
    "TaperController total_steps 0": (
        lambda tmp: TaperController(_paper(), total_steps=0),
        ConfigurationError,
        "total_steps must be a positive int, got 0",
    ),
    "TaperController total_steps 2.5": (
        lambda tmp: TaperController(_paper(), total_steps=2.5),
        ConfigurationError,
        "got 2.5",
    ),
    "TaperController total_steps True": (
        lambda tmp: TaperController(_paper(), total_steps=True),
        ConfigurationError,
        "got True",
    ),
    "TaperController total_steps '10'": (
        lambda tmp: TaperController(_paper(), total_steps="10"),
        ConfigurationError,
        "got '10'",
    ),
    "TaperController loop with the model in eval mode": (
        lambda tmp: _controller_loop(train=False),
        CalibrationError,
        "run training-mode forwards (model.train())",
    ),
    "TaperController jumping past k_start untrained": (
        lambda tmp: TaperController(_paper(taper_start=2, taper_end=4), total_steps=6).step_begin(4),
        CalibrationError,
        "has no calibration statistics",
    ),
    "TaperCallback with taper_start after taper_end": (
        _trainer_with_reversed_window,
        ConfigurationError,
        "k_end must be greater than k_start",
    ),
    "patch_model of DataParallel": (
        lambda tmp: patch_model(torch.nn.DataParallel(_llama()), TaperNormConfig.paper()),
        UnsupportedModelError,
        "DataParallel has no config.model_type",
    ),
    "set_gate nan": (lambda tmp: set_gate(tapered("llama"), float("nan")), ConfigurationError, "got nan"),
    "load_tapered of a folded export": (
        lambda tmp: load_tapered(export_folded(fold_model(tapered("llama")), tmp / "e")),
        ConfigurationError,
        "is not a tapered checkpoint",
    ),
}


@pytest.mark.parametrize("name", list(LIBRARY_REFUSALS))
def test_a_library_misuse_is_refused_with_one_clear_error(tmp_path, name):
    call, error_type, fragment = LIBRARY_REFUSALS[name]
    with pytest.raises(error_type) as caught:
        call(tmp_path)
    assert fragment in str(caught.value)


def test_export_folded_overwrite_true_onto_a_model_leaves_it_as_it_was(tmp_path):
    with pytest.raises(ConfigurationError):
        _export_over_a_model(tmp_path)
    assert json.loads((tmp_path / "my_model" / "config.json").read_text())["model_type"] == "llama"
    assert not (tmp_path / "my_model" / ".hf_tapernorm_export.json").exists()
    export = export_folded(fold_model(tapered("llama")), tmp_path / "export")
    export_folded(fold_model(tapered("llama")), export, overwrite=True)  # an earlier export is still replaced


# ============================================================================= data: what a document is
def _documents(path: Path, tmp: Path) -> list[str]:
    return load_text_dataset(str(path), cache_dir=str(tmp / "cache"))["text"]


def test_a_byte_order_mark_is_not_text_of_the_first_document(ws, tmp_path):
    plain = _documents(ws / "corpus.txt", tmp_path)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + (ws / "corpus.txt").read_bytes())
    assert _documents(tmp_path / "bom.txt", tmp_path) == plain


def test_crlf_nul_bytes_and_an_upper_case_suffix_read_as_the_same_documents(ws, tmp_path):
    text = (ws / "corpus.txt").read_text()
    plain = _documents(ws / "corpus.txt", tmp_path)
    (tmp_path / "crlf.txt").write_bytes(text.replace("\n", "\r\n").encode())
    (tmp_path / "UPPER.TXT").write_text(text)
    (tmp_path / "nul.txt").write_text(text[:3000] + "\0" + text[3000:])
    assert _documents(tmp_path / "crlf.txt", tmp_path) == plain
    assert _documents(tmp_path / "UPPER.TXT", tmp_path) == plain
    with_nul = _documents(tmp_path / "nul.txt", tmp_path)
    assert len(with_nul) == len(plain) and sum("\0" in d for d in with_nul) == 1


def test_a_data_folder_skips_hidden_copies_and_accepts_a_trailing_slash(ws, tmp_path):
    folder = tmp_path / "data"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "a.txt").write_text((ws / "corpus.txt").read_text())
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text((ws / "corpus.txt").read_text())
    (folder / ".notes.txt").write_text("a private note\n\nnot corpus")
    expected = _documents(ws / "corpus.txt", tmp_path)
    assert _documents(folder, tmp_path) == expected
    assert _documents(Path(str(folder) + "/"), tmp_path) == expected


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_byte_order_mark_in_jsonl_or_csv_leaves_the_text_column(tmp_path, suffix):
    docs = corpus_documents(20)
    if suffix == "jsonl":
        body = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    else:
        body = "text\n" + "".join(f'"{d}"\n' for d in docs)
    (tmp_path / f"bom.{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
    dataset = load_text_dataset(str(tmp_path / f"bom.{suffix}"), cache_dir=str(tmp_path / "cache"))
    assert dataset.column_names == ["text"] and dataset["text"] == docs


# ============================================================================= paths: '~', symlinks, slashes, case
def test_an_upper_case_options_file_with_a_home_output_dir_and_a_symlinked_model(ws, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "model_link").symlink_to(ws / "llama", target_is_directory=True)
    argv = taper(ws, "~/run/", model=str(tmp_path / "model_link"))
    options = {argv[i][2:]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    options.pop("use_cpu")
    (tmp_path / "RUN.YAML").write_text(yaml.safe_dump({**options, "use_cpu": True}))
    code, _, stderr = run_main(["taper", str(tmp_path / "RUN.YAML")])
    assert code == 0, stderr[-2000:]
    report = json.loads((tmp_path / "home" / "run" / "report.json").read_text())
    assert report["status"] == "finished" and not (tmp_path / "~").exists()


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


def test_fold_of_a_checkpoint_with_a_trailing_slash_and_eval_in_float16(run, tmp_path):
    assert run_main(fold(str(run / "checkpoint-6") + "/", tmp_path / "export"))[0] == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "tapernorm_llama"
    code, out, _ = run_main(evaluate(run / "folded", "--dtype", "float16"))
    assert code == 0 and json.loads(out.splitlines()[0])["kind"] == "folded"


def test_fold_overwrite_of_the_runs_own_export_replaces_it_with_the_same_model(run, tmp_path):
    folder = copy_of(run, tmp_path)
    before = (folder / "folded" / "model.safetensors").read_bytes()
    assert run_main(fold(folder / "tapered", folder / "folded", "--overwrite"))[0] == 0
    assert (folder / "folded" / "model.safetensors").read_bytes() == before


# ============================================================================= a finished run edited by hand, --resume
@pytest.mark.parametrize("edit", ["delete tapered/", "truncate report.json", "edit tapered/tapernorm_config.json"])
def test_resume_of_a_finished_run_edited_by_hand_restores_its_outputs(ws, run, tmp_path, edit):
    folder = copy_of(run, tmp_path)
    if edit == "delete tapered/":
        shutil.rmtree(folder / "tapered")
    elif edit == "truncate report.json":
        truncate(folder / "report.json", 100)
    else:
        edit_json(folder / "tapered" / "tapernorm_config.json", scope="all")
    code, _, stderr = run_main(taper(ws, folder, "--resume"))
    assert code == 0, stderr[-2000:]
    assert json.loads((folder / "report.json").read_text())["status"] == "finished"
    assert json.loads((folder / "tapered" / "tapernorm_config.json").read_text())["scope"] == "internal"
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


# ============================================================================= push, against a stand-in Hub
@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub.HfApi stand-in: records, per repository, the files upload_folder's filter would send."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    uploads: dict[str, list[str]] = {}

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, **options):
        files = [p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()]
        uploads[repo_id] = sorted(filter_repo_objects(files, allow_patterns=allow_patterns))
        return SimpleNamespace(commit_url=f"https://example.invalid/{repo_id}")

    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id)
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return uploads


def _push(folder, repo: str, *extra: str) -> int:
    return run_main(["push", "--export_dir", str(folder), "--repo_id", repo, *extra])[0]


def test_push_uploads_exactly_the_manifest_by_a_symlink_or_a_trailing_slash(run, tmp_path, hub):
    manifest = json.loads((run / "folded" / ".hf_tapernorm_export.json").read_text())["files"]
    (tmp_path / "link").symlink_to(run / "folded", target_is_directory=True)
    assert _push(run / "folded", "me/plain") == 0
    assert _push(tmp_path / "link", "me/link") == 0
    assert _push(str(run / "folded") + "/", "me/slash") == 0
    assert hub["me/plain"] == hub["me/link"] == hub["me/slash"] == sorted(manifest)


def test_push_include_names_a_file_literally_and_star_means_everything(run, tmp_path, hub):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "[tokenizer].json").write_text("{}")
    (folder / "folded" / "samples").mkdir()
    (folder / "folded" / "samples" / "a.txt").write_text("sample")
    assert _push(folder / "folded", "me/literal", "--include", "[tokenizer].json", "samples/*") == 0
    assert {"[tokenizer].json", "samples/a.txt"} <= set(hub["me/literal"])
    assert _push(folder / "folded", "me/all", "--include", "*") == 0
    assert set(hub["me/all"]) == set(hub["me/literal"])


def test_files_to_push_reads_one_include_string_as_one_pattern(run, tmp_path):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "secret.env").write_text("HF_TOKEN=x")
    with pytest.raises(ConfigurationError, match=r"did not write \(secret\.env\)"):
        files_to_push(folder / "folded", include="README*")  # its letters were patterns, "*" among them
    assert "secret.env" in files_to_push(folder / "folded", include="secret.env")


def test_push_of_an_export_whose_model_card_was_emptied_uploads_it_as_is(run, tmp_path, hub):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "README.md").write_text("")
    assert _push(folder / "folded", "me/empty_card") == 0 and "README.md" in hub["me/empty_card"]


# ============================================================================= the library on odd but valid input
def test_fold_model_leaves_the_tapered_model_as_it_was():
    model = tapered("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = logits(model, IDS)
    folded = fold_model(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, IDS), expected) and relative_error(logits(folded, IDS), expected) <= 1e-5


def test_fold_model_of_a_gpt2_left_in_train_mode_checks_without_dropout():
    model = tapered("gpt2").train()  # GPT-2's dropout is 0.1: a check in train mode would fail at random
    folded = fold_model(model)
    assert model.training and not folded.training and folded.fold_report.max_rel_diff <= 1e-5


def test_fold_model_in_float16_uses_its_own_tolerance():
    folded = fold_model(tapered("llama", dtype=torch.float16))
    assert folded.dtype == torch.float16
    assert folded.fold_report.dtype == "float16" and folded.fold_report.max_rel_diff <= folded.fold_report.tolerance


def test_a_probe_longer_than_the_models_positions_is_fine_for_rotary():
    assert fold_model(tapered("llama"), probe=torch.randint(0, 128, (1, 200))).fold_report.probe_shape == (1, 200)


def test_a_tokenizer_without_bos_gives_the_eos_as_the_sink():
    with pytest.warns(UserWarning, match=r"does not start its output with the sink token\(s\) \[127\]"):
        model = patch_model(_llama(), tokenizer=char_tokenizer())
    assert model.tapernorm_config.sink_token_ids == [127]


def test_callback_allow_changes_given_as_one_string_is_one_field():
    assert TaperCallback(allow_changes="scope").allow_changes == {"scope"}


def test_a_new_controller_on_a_tapered_model_starts_its_schedule_at_gate_1():
    model = tapered("llama")
    controller = TaperController(model, total_steps=100)
    assert controller.step_begin(-5) == 1.0 and controller.step_begin(0) == 1.0
    assert all(float(layer.gate) == 1.0 for layer in model.modules() if getattr(layer, "tapered", False))


def test_an_empty_input_fails_in_the_export_as_in_the_original(tmp_path):
    empty = torch.zeros((1, 0), dtype=torch.long)
    folded = _loaded_export("llama", tmp_path)
    with pytest.raises(RuntimeError) as original:
        _llama()(input_ids=empty)
    with pytest.raises(RuntimeError) as export:
        folded(input_ids=empty)
    assert str(export.value) == str(original.value)  # transformers' own error, not one of the fold's


# ============================================================================= a loaded export
@pytest.fixture(scope="module", params=["llama", "gpt2", "llama-sink"])
def export(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    model = tapered(kind, sink_token_ids=[1] if request.param.endswith("sink") else None)
    folder = export_folded(fold_model(model), tmp_path_factory.mktemp("export") / "out", tokenizer=char_tokenizer())
    return model, folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    sink = list(model.tapernorm_config.sink_token_ids)
    with torch.no_grad():
        if not sink:
            return model(input_ids=ids).logits
        return model(input_ids=torch.cat([torch.tensor([sink] * len(ids)), ids], 1)).logits[:, len(sink) :]


def test_a_loaded_export_matches_the_tapered_model_and_survives_a_save(export, tmp_path):
    model, folder, folded = export
    with torch.no_grad():
        assert relative_error(folded(input_ids=IDS).logits, _reference(model, IDS)) <= 1e-5
        folded.save_pretrained(tmp_path / "again")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
        assert torch.equal(again(input_ids=IDS).logits, folded(input_ids=IDS).logits)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # with hf_tapernorm imported
    assert type(remote).__name__ == type(folded).__name__
    assert (
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)(input_ids=IDS).logits.dtype == torch.bfloat16
    )
    assert (export_folded(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "re") / "config.json").is_file()


def test_a_loaded_export_pads_left_and_right_like_single_rows(export):
    _, _, folded = export
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(5))
    left = ids.clone()
    left[0, :3] = 0
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    batched = folded.generate(input_ids=left, attention_mask=mask, **options)
    assert torch.equal(batched[0, -4:], folded.generate(input_ids=ids[:1, 3:], **options)[0, -4:])
    right = torch.ones_like(ids)
    right[1, 5:] = 0
    with torch.no_grad():
        padded = folded(input_ids=ids, attention_mask=right).logits[1, :5]
        assert relative_error(padded, folded(input_ids=ids[1:, :5]).logits[0]) <= 1e-5


def test_a_loaded_export_samples_and_beam_searches(export):
    _, _, folded = export
    prompt = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    sampled = folded.generate(prompt, do_sample=True, temperature=0.7, top_k=5, max_new_tokens=3)
    beams = folded.generate(prompt, num_beams=2, max_new_tokens=3, do_sample=False)
    assert sampled.shape == beams.shape == (1, 8) and torch.equal(sampled[:, :5], prompt)


# ============================================================================= tapered checkpoints (checkpoints.py)
def test_save_tapered_into_a_file_path_is_refused_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigurationError, match="is a file"):
        save_tapered(tapered("llama"), tmp_path / "afile")


def test_save_tapered_refuses_a_folder_holding_another_model(tmp_path):
    folder = save_tiny_model(tmp_path / "my_model")
    before = snapshot(folder)
    with pytest.raises(ConfigurationError, match="holds another model"):
        save_tapered(tapered("llama"), folder)
    assert snapshot(folder) == before


def test_load_tapered_of_a_missing_folder_says_not_found(tmp_path):
    with pytest.raises(ConfigurationError, match="not found|does not exist|no such folder"):
        load_tapered(tmp_path / "nothing")
