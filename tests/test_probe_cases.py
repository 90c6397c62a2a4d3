"""The hostile probe's cases that must stop early: each with one line naming the option or file and what to do.

The cases are what a new user hands the CLI (conversion_scripts/experiments/reports/probe.md lists them with their
outcome before and after); none of them may load weights, train or end in a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from hf_tapernorm.cli import main
from tests.conftest import corpus_documents, save_tiny_model


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe_cases")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(bytes(range(128, 256)) * 20)
    (root / "emptydir").mkdir()
    (root / "nocol.csv").write_text("a,b\n1,2\n")
    (root / "tiny.txt").write_text("short\n\nx\n")
    (root / "nulls.jsonl").write_text(
        "".join(json.dumps({"text": None if i % 2 else f"document {i} " * 8}) + "\n" for i in range(200))
    )
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "empty.yaml").write_text("")
    (root / "unknown.yaml").write_text("max_steps: 4\nbogus_option: 3\n")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{bad")
    return root


def _taper(ws: Path, *extra: str, model: str = "llama", data: str = "corpus.txt") -> list[str]:
    return [
        "taper", "--model_name_or_path", str(ws / model), "--dataset_name", str(ws / data), "--block_size", "32",
        "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--output_dir", str(ws / "out"), "--use_cpu", "--disable_tqdm", "true", "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", *extra,
    ]  # fmt: skip


#: name -> (arguments of the command (a function of the workspace), fragments the one-line error must hold)
CASES = {
    "empty data file": (lambda ws: _taper(ws, data="empty.txt"), ["empty.txt", "is empty"]),
    "binary data file": (lambda ws: _taper(ws, data="binary.txt"), ["not UTF-8", "convert it"]),
    "data folder without text files": (lambda ws: _taper(ws, data="emptydir"), ["holds no", ".txt"]),
    "csv without a text column": (lambda ws: _taper(ws, data="nocol.csv"), ["--text_column"]),
    "jsonl rows without text": (lambda ws: _taper(ws, data="nulls.jsonl"), ["row 1", "no 'text' value"]),
    "data smaller than a block": (lambda ws: _taper(ws, data="tiny.txt"), ["too small", "--block_size"]),
    "options file holding a list": (lambda ws: ["taper", str(ws / "list.yaml")], ["one object"]),
    "empty options file": (lambda ws: ["taper", str(ws / "empty.yaml")], ["one object"]),
    "unknown option in a file": (lambda ws: ["taper", str(ws / "unknown.yaml")], ["unknown options", "bogus_option"]),
    "model is a text file": (lambda ws: _taper(ws, model="corpus.txt"), ["is a file, not a model", "config.json"]),
    "model config not JSON": (lambda ws: _taper(ws, model="badjson"), ["cannot read the config", "badjson"]),
    "block size beyond positions": (lambda ws: _taper(ws, "--block_size", "100000"), ["64 positions"]),
    "batch size 0": (lambda ws: _taper(ws, "--per_device_train_batch_size", "0"), ["--per_device_train_batch_size"]),
    "held out 100%": (lambda ws: _taper(ws, "--heldout_percentage", "100"), ["--heldout_percentage"]),
    "taper end before start": (lambda ws: _taper(ws, "--taper_start", "0.9", "--taper_end", "0.5"), ["--taper_end"]),
    "keep_norms matching nothing": (lambda ws: _taper(ws, "--keep_norms", "nope.*"), ["match no norm"]),
    "negative seed": (lambda ws: _taper(ws, "--seed", "-1"), ["--seed"]),
    "gradient accumulation 0": (lambda ws: _taper(ws, "--gradient_accumulation_steps", "0"), ["accumulation"]),
    "scheduler kwargs not JSON": (
        lambda ws: _taper(ws, "--lr_scheduler_kwargs", "{nope"),
        ["--lr_scheduler_kwargs", "not a JSON object"],
    ),
    "scheduler kwargs of the wrong type": (
        lambda ws: _taper(
            ws, "--lr_scheduler_type", "cosine_with_restarts", "--lr_scheduler_kwargs", '{"num_cycles": "x"}'
        ),
        ["--lr_scheduler_type cosine_with_restarts"],
    ),
    "resume of a new folder": (lambda ws: _taper(ws, "--resume"), ["--resume", "holds no run to continue"]),
    "output_dir is a file": (
        lambda ws: [*_taper(ws), "--output_dir", str(ws / "corpus.txt")],
        ["corpus.txt' is a file"],
    ),
    "text column not in the data": (lambda ws: _taper(ws, "--text_column", "body", data="nulls.jsonl"), ["'body'"]),
    "eval batch size 0": (lambda ws: _taper(ws, "--eval_batch_size", "0"), ["--eval_batch_size"]),
    "out-of-corpus data missing": (
        lambda ws: _taper(ws, "--out_of_corpus_dataset", str(ws / "nope.txt"), "--out_of_corpus_blocks", "4"),
        ["nope.txt", "not found"],
    ),
    "allow_changes without resume": (lambda ws: _taper(ws, "--allow_changes", "seed"), ["--resume only"]),
    "gguf_file without a model": (
        lambda ws: ["taper", "--gguf_file", "x.gguf", "--output_dir", str(ws / "out")],
        ["--model_name_or_path"],
    ),
    "batch larger than the data": (
        lambda ws: _taper(ws, "--per_device_train_batch_size", "100000"),
        ["fewer than one batch"],
    ),
    "negative learning rate": (lambda ws: _taper(ws, "--learning_rate", "-1"), ["learning rate"]),
    "NaN learning rate": (lambda ws: _taper(ws, "--learning_rate", "nan"), ["--learning_rate must be a finite"]),
    "explicit warmup past the taper start": (lambda ws: _taper(ws, "--warmup_steps", "2.5"), ["--warmup_steps 2.5"]),
    "logging_steps 0": (lambda ws: _taper(ws, "--logging_steps", "0"), ["--logging_steps"]),
    "negative distillation weight": (lambda ws: _taper(ws, "--distill_weight", "-1"), ["--distill_weight"]),
    "max_steps 1": (lambda ws: [*_taper(ws), "--max_steps", "1"], ["--max_steps must be at least 2"]),
    "unknown flag": (lambda ws: _taper(ws, "--bogus", "1"), ["unrecognized arguments", "--bogus"]),
    "eval result in a missing folder": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "llama"), "--output_json", str(ws / "no" / "r.json")],
        ["does not exist"],
    ),
    "eval result over a model's config": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "llama"), "--output_json", str(ws / "llama/config.json")],
        ["not an earlier result"],
    ),
    "eval of a missing model": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "nothing")],
        ["not found"],
    ),
    "fold of an original model": (
        lambda ws: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(ws / "x")],
        ["not a tapered checkpoint"],
    ),
    "fold tolerance 0": (
        lambda ws: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(ws / "x"), "--tolerance", "0"],
        ["--tolerance must be positive"],
    ),
    "push of a missing export": (
        lambda ws: ["push", "--export_dir", str(ws / "nothing"), "--repo_id", "me/x"],
        ["not found"],
    ),
    "push to a malformed repo id": (
        lambda ws: ["push", "--export_dir", str(ws / "llama"), "--repo_id", "x"],
        ["'owner/name'"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_stops_early_with_one_line(ws, name):
    make_argv, fragments = CASES[name]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(make_argv(ws))
    line = err.getvalue().strip().splitlines()[-1]
    assert code == 2 and line.startswith("hf-tapernorm ") and ": error: " in line, err.getvalue()
    for fragment in fragments:
        assert fragment in line, line
    assert not (ws / "out").exists() and not (ws / "x").exists()  # nothing written
