"""Options files (``hf-tapernorm taper run.json``, ``run.yaml``): read as the flags they stand for, by the same parse.

A file's values get the command line's types, choices and checks whatever the source: ``"trust_remote_code":
"false"`` is false (it never runs a model's code), ``sink: bogus`` is refused as ``--sink bogus`` is, and a value the
command line would refuse only after training (``tied_head: scal``) is refused before anything is read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

from hf_tapernorm._parsing import UsageError, parse
from hf_tapernorm.bench.arguments import BenchArguments
from hf_tapernorm.cli.arguments import (
    DataArguments,
    EvalArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.cli.export_arguments import FoldArguments, PushArguments
from hf_tapernorm.errors import ConfigurationError
from tests.conftest import corpus_documents, save_tiny_model
from tests.helpers import error_of, run_main, snapshot
from tests.helpers import short_taper_argv as taper

COMMANDS = {
    "taper": [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments],
    "eval": [ModelArguments, DataArguments, EvalArguments],
    "fold": [FoldArguments],
    "push": [PushArguments],
    "bench": [BenchArguments],
}
TAPER_OPTIONS = COMMANDS["taper"]


def write_options(folder: Path, name: str, values: dict) -> Path:
    """``values`` as the options file ``folder/name`` (JSON or YAML by its suffix)."""
    path = folder / name
    path.write_text(json.dumps(values) if name.endswith(".json") else yaml.safe_dump(values))
    return path


def parsed(command: str, argv: list[str]) -> tuple:
    return parse(COMMANDS[command], argv, f"hf-tapernorm {command}")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("options_files")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


# ----------------------------------------------------------------------------- one parse for both sources
#: command -> (the options file's object, the command line it stands for)
SAME_AS_FLAGS = {
    "taper": (
        {
            "trust_remote_code": "false", "bf16": "false", "baseline": "no", "overwrite": "False", "sink": "none",
            "preset": "paper", "tied_head": "scale", "sample_by": "line", "max_steps": "2e1", "learning_rate": "3e-4",
            "taper_end": 5, "keep_norms": "a.*,b.*", "lr_scheduler_kwargs": {"min_lr": 0.0}, "block_size": 64,
            "dataset_name": None, "output_dir": "runs/x",
        },
        [
            "--trust_remote_code", "false", "--bf16", "false", "--baseline", "no", "--overwrite", "False",
            "--sink", "none", "--preset", "paper", "--tied_head", "scale", "--sample_by", "line", "--max_steps", "20",
            "--learning_rate", "3e-4", "--taper_end", "5", "--keep_norms", "a.*,b.*",
            "--lr_scheduler_kwargs", '{"min_lr": 0.0}', "--block_size", "64", "--output_dir", "runs/x",
        ],
    ),
    "eval": (
        {"trust_remote_code": "no", "sink": "bos", "scan_windows": 0, "streaming": True},
        ["--trust_remote_code", "no", "--sink", "bos", "--scan_windows", "0", "--streaming"],
    ),
    "fold": (
        {"checkpoint": "run/tapered", "output_dir": "export", "tied_head": "scale", "overwrite": "true"},
        ["--checkpoint", "run/tapered", "--output_dir", "export", "--tied_head", "scale", "--overwrite", "true"],
    ),
    "push": (
        {"export_dir": "e", "repo_id": "me/x", "private": "false", "include": ["a/*", "b.txt"]},
        ["--export_dir", "e", "--repo_id", "me/x", "--private", "false", "--include", "a/*", "b.txt"],
    ),
    "bench": (
        {"modes": ["last", "full"], "batch_sizes": [1, 2.0], "op_counts": "no", "execution": "eager"},
        ["--modes", "last", "full", "--batch_sizes", "1", "2", "--op_counts", "no", "--execution", "eager"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize("command", list(SAME_AS_FLAGS))
def test_an_options_file_parses_as_the_flags_it_stands_for(command, suffix, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # bench checks its default output folder
    values, argv = SAME_AS_FLAGS[command]
    from_file = parsed(command, [str(write_options(tmp_path, "run" + suffix, values))])
    assert from_file == parsed(command, argv)


def test_file_values_have_the_command_line_s_types(tmp_path):
    """The cases a file used to get wrong: text read as true, a typo read as the default."""
    options = write_options(
        tmp_path,
        "run.json",
        {
            "trust_remote_code": "false",
            "bf16": "false",
            "baseline": "no",
            "overwrite": "false",
            "save_total_limit": None,
        },
    )
    model, _, _, run, training = parsed("taper", [str(options)])
    assert model.trust_remote_code is False and training.bf16 is False  # fp32, whatever this CPU is
    assert run.baseline is False and run.overwrite is False
    assert training.save_total_limit == 1  # null: the option's default
    (tmp_path / "run.yaml").write_text("trust_remote_code: 'no'\nsink: null\n")
    model, _, taper, *_ = parsed("taper", [str(tmp_path / "run.yaml")])
    assert model.trust_remote_code is False and taper.sink is None
    (tmp_path / "eval.yaml").write_text("trust_remote_code: 'false'\n")
    assert parsed("eval", [str(tmp_path / "eval.yaml")])[0].trust_remote_code is False


#: name -> (command, options file name, its text, fragments of the one-line error)
REFUSED = {
    "sink bogus": ("taper", "run.yaml", "sink: bogus\n", ["run.yaml: argument --sink", "choice: 'bogus'", "bos"]),
    "sink None (text)": ("taper", "run.yaml", "sink: None\n", ["--sink", "invalid choice: 'None'"]),
    "eval sink NONE": ("eval", "eval.yaml", "sink: NONE\n", ["--sink", "invalid choice: 'NONE'", "auto"]),
    "preset papper": ("taper", "run.json", '{"preset": "papper"}', ["--preset", "invalid choice: 'papper'", "paper"]),
    "tied_head scal": ("taper", "run.yaml", "tied_head: scal\n", ["--tied_head", "invalid choice: 'scal'", "untie"]),
    "fold tied_head scal": ("fold", "f.yaml", "checkpoint: c\noutput_dir: o\ntied_head: scal\n", ["--tied_head"]),
    "sample_by lines": ("taper", "run.yaml", "sample_by: lines\n", ["--sample_by", "invalid choice: 'lines'", "line"]),
    "a bool that is no bool word": (
        "taper", "run.json", '{"trust_remote_code": "maybe"}', ["--trust_remote_code", "maybe", "true/false"],
    ),
    "a list for a one-value option": ("taper", "run.yaml", "sink: [bos, none]\n", ["sink takes one value"]),
    # a one-item list was read as its item; only an option whose field takes a list (report_to) reads one so
    "a one-item list for a number": (
        "taper", "run.yaml", "block_size: [16]\n", ["block_size takes one value, got a one-item list: write the item"],
    ),
    # and a list of one list said so too, which left a list once its brackets went
    "a list of one list for a number": (
        "taper", "run.yaml", "block_size: [[16]]\n", ["block_size takes one value, got the list [['16']] (see "],
    ),
    "a list of one object for a number": (
        "taper", "run.json", '{"block_size": [{"a": 1}]}', ["block_size takes one value, got the list [{'a': 1}] ("],
    ),
    "a one-item list for a choice": (
        "eval", "eval.json", '{"sink": ["none"]}', ["sink takes one value, got a one-item list"],
    ),
    "a list in a list": ("taper", "run.yaml", "keep_norms: [[a]]\n", ["keep_norms takes text, got [\"a\"]"]),
    "a bool for a path": ("taper", "run.json", '{"output_dir": true}', ["run.json: output_dir takes text, got true"]),
    "an object for a path": ("taper", "run.json", '{"output_dir": {"a": 1}}', ['output_dir takes text, got {"a": 1}']),
    "eval output_json true": ("eval", "eval.json", '{"output_json": true}', ["output_json takes text, got true"]),
    "a YAML bool for a choice": ("taper", "run.yaml", "sink: no\n", ["sink takes one of auto, bos, none, got false"]),
    "an empty list for a non-empty default": ("bench", "b.json", '{"batch_sizes": []}', ["--batch_sizes", "expected"]),
    "a bench choice": ("bench", "b.yaml", "modes: [last, lats]\n", ["--modes", "'lats'", "decode"]),
    "text for a number": ("taper", "run.yaml", "learning_rate: fast\n", ["learning_rate must be a number"]),
    "a fraction for an integer": ("taper", "run.yaml", "max_steps: 2.5\n", ["max_steps must be an integer"]),
    "a required option missing": ("push", "p.yaml", "repo_id: me/x\n", ["--export_dir"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_bad_value_in_an_options_file_is_refused_as_on_the_command_line(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command, file_name, text, fragments = REFUSED[name]
    values = json.loads(text) if file_name.endswith(".json") else yaml.safe_load(text)
    if command in ("taper", "eval"):  # were the value read, the command would stop at once, not train a default
        values["model_name_or_path"] = str(tmp_path / "no_model")
    write_options(tmp_path, file_name, values)
    line = error_of([command, str(tmp_path / file_name)])
    assert line.startswith(f"hf-tapernorm {command}: error: "), line
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "true").exists()  # refused before any write


def test_unknown_keys_are_refused_together_and_named(tmp_path):
    options = write_options(tmp_path, "run.yaml", {"max_steps": 4, "bogus": 1, "per_device_batch": 2})
    with pytest.raises(UsageError, match=r"run.yaml: unknown options \['bogus', 'per_device_batch'\]"):
        parsed("taper", [str(options)])


# ----------------------------------------------------------------------------- end to end
def _remote_code_model(folder: Path, marker: Path) -> Path:
    """A model folder whose config names custom code; importing that code writes ``marker``."""
    save_tiny_model(folder, "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="marker_llama",
        auto_map={"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "marker.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class MarkerConfig(LlamaConfig):\n    model_type = 'marker_llama'\n\n\n"
        "class MarkerModel(LlamaForCausalLM):\n    config_class = MarkerConfig\n"
    )
    return folder


@pytest.mark.parametrize(
    ("command", "file_name", "value"),
    [("taper", "run.json", "false"), ("taper", "run.yaml", "no"), ("eval", "eval.json", "false")],
)
def test_remote_code_runs_only_when_the_file_says_true(ws, tmp_path, command, file_name, value):
    marker = tmp_path / "remote_code_ran"
    model = _remote_code_model(tmp_path / "custom", marker)
    values = {"model_name_or_path": str(model), "dataset_name": str(ws / "corpus.txt"), "trust_remote_code": value}
    values.update(block_size=32, heldout_blocks=4, scan_windows=0, out_of_corpus_blocks=0)
    if command == "taper":
        values.update(output_dir=str(tmp_path / "out"), max_steps=2, use_cpu=True)
    path = write_options(tmp_path, file_name, values)
    assert f"trust_remote_code: '{value}'" in path.read_text() or file_name.endswith(".json")  # YAML: text, quoted
    line = error_of([command, str(path)])
    assert "contains custom code" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_overwrite_false_in_a_file_keeps_a_finished_run(ws, tmp_path):
    out = tmp_path / "run"
    values = {
        "model_name_or_path": str(ws / "llama"), "dataset_name": str(ws / "corpus.txt"), "block_size": 32,
        "heldout_blocks": 4, "heldout_percentage": 10, "max_steps": 2, "output_dir": str(out), "use_cpu": True,
        "disable_tqdm": True, "out_of_corpus_blocks": 0, "scan_windows": 0,
    }  # fmt: skip
    argv = ["taper", *(text for key, value in values.items() for text in (f"--{key}", str(value).lower()))]
    code, _, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    before = snapshot(out)
    refusal = error_of([*argv, "--overwrite", "false"])
    assert "is not empty; pass --overwrite" in refusal
    assert error_of(["taper", str(write_options(tmp_path, "run.json", {**values, "overwrite": "false"}))]) == refusal
    assert snapshot(out) == before


# ============================================================================= numbers, case and paths
def test_yaml_numbers_without_a_dot_are_numbers(ws, tmp_path):
    options = tmp_path / "run.yaml"
    options.write_text("max_grad_norm: 1e-1\nlearning_rate: 3e-4\nmax_steps: 2e1\noutput_dir: out\n")
    assert isinstance(yaml.safe_load(options.read_text())["learning_rate"], str)  # YAML 1.1: text, not a float
    *_, training = parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    assert (training.max_grad_norm, training.learning_rate, training.max_steps) == (0.1, 3e-4, 20)
    options.write_text("learning_rate: fast\n")
    with pytest.raises(UsageError, match="learning_rate must be a number, got 'fast'"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    options.write_text("max_steps: 2.5\n")
    with pytest.raises(UsageError, match="max_steps must be an integer"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    options.write_text("max_steps: [1\n")
    with pytest.raises(UsageError, match="cannot read it"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")


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


# ============================================================================= lists, byte order marks
#: command -> (an options file's object with lists, the command line it stands for)
LISTS_AS_FLAGS = {
    "a one-element list for a one-value option": (
        "taper",
        {"report_to": ["none"], "keep_norms": ["model.norm"], "output_dir": "runs/x"},
        ["--report_to", "none", "--keep_norms", "model.norm", "--output_dir", "runs/x"],
    ),
    "a list for a comma-separated option": (
        "taper",
        {"keep_norms": ["a.*", "b.*"], "resume": True, "allow_changes": ["learning_rate", "seed"]},
        ["--keep_norms", "a.*,b.*", "--resume", "--allow_changes", "learning_rate,seed"],
    ),
    "an empty list for an option whose default is empty": (
        "push",
        {"export_dir": "e", "repo_id": "me/x", "include": []},
        ["--export_dir", "e", "--repo_id", "me/x"],
    ),
}


@pytest.mark.parametrize("name", list(LISTS_AS_FLAGS))
def test_a_list_reads_as_the_command_line_writes_it(name, tmp_path):
    """They were refused: "takes one value, got the list ['none']"; push's {"include": []} (its default) as
    "expected at least one argument"."""
    command, values, argv = LISTS_AS_FLAGS[name]
    assert parsed(command, [str(write_options(tmp_path, "run.json", values))]) == parsed(command, argv)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_an_options_file_with_a_byte_order_mark(tmp_path, suffix):
    """Editors that write UTF-8 with a BOM: the file was refused as unreadable."""
    path = tmp_path / f"run{suffix}"
    path.write_text("\ufeff" + (json.dumps({"max_steps": 7}) if suffix == ".json" else "max_steps: 7\n"))
    assert parsed("taper", [str(path)])[-1].max_steps == 7


def test_a_key_spelled_like_the_dash_flag_is_that_option(tmp_path):
    """--model-name-or-path works on the command line; the same spelling in a file was an unknown option."""
    values = {"model-name-or-path": "some/model", "max-steps": 7}
    model, *_, training = parsed("taper", [str(write_options(tmp_path, "run.json", values))])
    assert model.model_name_or_path == "some/model" and training.max_steps == 7


@pytest.mark.parametrize("text", ["model_name_or_path: x\n1: 2\n", "~: 2\n"])
def test_an_option_name_that_is_not_text_is_one_line(tmp_path, text):
    """YAML reads `1:` and `~:` as a number and a null: an AttributeError from inside the parser."""
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(UsageError, match=r"run.yaml: option names are text, got (1|None)"):
        parsed("eval", [str(tmp_path / "run.yaml")])


# ============================================================================= text as written, empty lists, flags
#: name -> (command, a YAML options file, {option: its value once parsed}): YAML 1.1 reads `010` as 8, `12:30` as 750,
#: `0x1F` as 31; every option gets the text the file holds, as its flag would (`max_steps: 010` is 10)
YAML_AS_WRITTEN = {
    "taper output_dir 010": ("taper", "output_dir: 010\nmax_steps: 020\n", {"output_dir": "010", "max_steps": 20}),
    "taper output_dir 12:30": ("taper", "output_dir: 12:30\nlearning_rate: 1e-3\n", {"output_dir": "12:30"}),
    "taper dataset_name 0x1F": ("taper", "dataset_name: 0x1F\ntaper_end: 010\n", {"dataset_name": "0x1F"}),
    "taper text_column a time": (
        "taper", "text_column: 2001-12-14t21:59:43.10-05:00\n", {"text_column": "2001-12-14t21:59:43.10-05:00"},
    ),
    "taper run_name and output_dir dates": (  # a date-looking text is text, tagged !!timestamp or not
        "taper", "run_name: 2024-01-01\noutput_dir: !!timestamp 2024-01-02\n",
        {"run_name": "2024-01-01", "output_dir": "2024-01-02"},
    ),
    "eval out_of_corpus_text_column 010": (
        "eval", "out_of_corpus_text_column: 010\n", {"out_of_corpus_text_column": "010"},
    ),
    "push include [010, 1.50]": (
        "push", "export_dir: e\nrepo_id: me/x\ninclude: [010, 1.50]\n", {"include": ["010", "1.50"]},
    ),
    "bench output_dir 010": ("bench", "output_dir: 010\nseq_lens: [010]\n", {"output_dir": "010", "seq_lens": [10]}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(YAML_AS_WRITTEN))
def test_a_text_option_keeps_the_yaml_text_as_written(name, tmp_path, monkeypatch):
    """They were YAML 1.1's numbers: `output_dir: 010` trained into the folder 8, `12:30` into 750."""
    monkeypatch.chdir(tmp_path)  # bench checks its output folder
    command, text, expected = YAML_AS_WRITTEN[name]
    (tmp_path / "run.yaml").write_text(text)
    values = {k: v for options in parsed(command, [str(tmp_path / "run.yaml")]) for k, v in vars(options).items()}
    assert {k: values[k] for k in expected} == expected
    if "taper_end" in text:  # a step is text on the command line too: 010 is step 10, not octal 8
        assert values["taper_end"] == 10
    if "learning_rate" in text:
        assert values["learning_rate"] == 1e-3


@pytest.mark.parametrize("option", ["save_strategy", "eval_strategy", "logging_strategy"])
def test_a_plain_yaml_no_is_the_choice_no_as_its_flag_reads_it(option, tmp_path):
    """`save_strategy: no` was YAML 1.1's false, refused as "takes one of no, steps, epoch, best or text, got false"
    although the file wrote no, as the command line does. An option with `no` among its choices reads the plain word
    as written now, as `--save_strategy no` does; `NO` is refused as `--save_strategy NO` is."""
    (tmp_path / "run.yaml").write_text(f"output_dir: out\n{option}: no\n")
    from_file = parsed("taper", [str(tmp_path / "run.yaml")])[-1]
    from_flags = parsed("taper", ["--output_dir", "out", f"--{option}", "no"])[-1]
    assert getattr(from_file, option).value == getattr(from_flags, option).value == "no"
    (tmp_path / "run.yaml").write_text(f"output_dir: out\n{option}: NO\n")
    with pytest.raises(UsageError) as from_file:
        parsed("taper", [str(tmp_path / "run.yaml")])
    with pytest.raises(UsageError) as from_flags:
        parsed("taper", ["--output_dir", "out", f"--{option}", "NO"])
    assert str(from_file.value) == f"{tmp_path / 'run.yaml'}: {from_flags.value}"
    assert f"argument --{option}/--{option.replace('_', '-')}: invalid choice: 'NO'" in str(from_flags.value)


def test_two_reporters_from_a_file_or_a_comma_separated_flag_are_the_trainer_s_list(tmp_path):
    """`report_to: [tensorboard, wandb]`, as the Trainer's own configs write it, was refused ("takes one value, got
    the list"), and `--report_to tensorboard,wandb` reached the Trainer as one reporter named "tensorboard,wandb".
    Both are now the list of reporters, which taper's early check takes one by one."""
    from_file = parsed("taper", [str(write_options(tmp_path, "run.yaml", {"report_to": ["tensorboard", "wandb"]}))])
    from_flag = parsed("taper", ["--report_to", "tensorboard, wandb"])
    assert from_file == from_flag
    assert from_file[4].report_to == from_flag[4].report_to == ["tensorboard", "wandb"]
    assert parsed("taper", ["--report_to", "wandb"])[4].report_to == ["wandb"]  # one, none: as before
    assert parsed("taper", ["--report_to", "none"])[4].report_to == []


#: name -> (command, an options file's object holding an empty list, the command line it stands for)
EMPTY_LISTS = {
    "keep_norms: [] keeps no norm": ("taper", {"keep_norms": []}, ["--keep_norms", "none"]),
    "report_to: [] reports nowhere": ("taper", {"report_to": []}, ["--report_to", "none"]),
    "allow_changes: [] allows none": ("taper", {"resume": True, "allow_changes": []}, ["--resume"]),
    "a one-value option: its default": ("taper", {"sink": [], "output_dir": []}, []),
}


@pytest.mark.parametrize("name", list(EMPTY_LISTS))
def test_an_empty_list_is_the_option_s_empty_value(name, tmp_path):
    """They were refused: "keep_norms takes one value, got the list []"."""
    command, values, argv = EMPTY_LISTS[name]
    assert parsed(command, [str(write_options(tmp_path, "run.json", values))]) == parsed(command, argv)
    if name.startswith("keep_norms"):
        assert parsed(command, argv)[2].keep_norms == []  # no norm kept, not the recipe's choice


PUSH = {"export_dir": "e", "repo_id": "me/x"}


@pytest.mark.parametrize(
    ("command", "values", "argv"),
    [
        ("push", {**PUSH, "no_private": True}, ["--export_dir", "e", "--repo_id", "me/x", "--no_private"]),
        ("push", {**PUSH, "no-private": "yes"}, ["--export_dir", "e", "--repo_id", "me/x", "--no_private"]),
        ("push", {**PUSH, "no_private": False}, ["--export_dir", "e", "--repo_id", "me/x", "--private", "true"]),
        ("bench", {"no_op_counts": True}, ["--no_op_counts"]),
    ],
)
def test_a_key_spelled_like_a_negative_flag_is_that_flag(command, values, argv, tmp_path, monkeypatch):
    """push's documented --no_private was "unknown options ['no_private']" in a file."""
    monkeypatch.chdir(tmp_path)
    assert parsed(command, [str(write_options(tmp_path, "run.yaml", values))]) == parsed(command, argv)
    write_options(tmp_path, "bad.yaml", {**PUSH, "no_private": "maybe"})
    with pytest.raises(UsageError, match=r"bad.yaml: no_private takes true or false, got 'maybe'"):
        parsed("push", [str(tmp_path / "bad.yaml")])


def test_push_s_no_private_has_its_own_help_text(capsys):
    """push --help gave --no_private the text of --private ("Create the repository as private ...", default False):
    transformers gives a bool's --no_ twin its option's help. A field's ``negated_help`` is the twin's text now."""
    from hf_tapernorm.cli import main

    with pytest.raises(SystemExit):
        main(["push", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    private, twin = text.split("--no_private, --no-private ", 1)
    assert "--private [PRIVATE] Create the repository as private (the default: " in private
    assert twin.startswith(
        "Create the repository as public (as --private false). An existing repository keeps its visibility. --include"
    )


#: name -> (command, an options file's text, the start of its one-line error after "hf-tapernorm CMD: error: FILE: ")
UNREADABLE = {
    "JSON nested 100000 deep": (
        "taper", '{"max_steps": 6, "x": ' + "[" * 100000 + "]" * 100000 + "}",
        "cannot read it (maximum recursion depth exceeded",
    ),
    "YAML nested 20000 deep": (
        "eval", "x: " + "[" * 20000 + "]" * 20000 + "\n", "cannot read it (maximum recursion depth exceeded",
    ),
    "fold output_dir with a NUL": (
        "fold", '{"checkpoint": "c", "output_dir": "runs/nul\\u0000x"}',
        "argument --output_dir/--output-dir: 'runs/nul\\x00x' holds a NUL byte (\\u0000), which no path or option "
        "value can hold",
    ),
    "fold output_dir with a lone surrogate": (
        "fold", '{"checkpoint": "c", "output_dir": "runs/sur\\ud800x"}',
        "argument --output_dir/--output-dir: 'runs/sur\\ud800x' holds '\\ud800', which is no character (a byte that "
        "is not UTF-8, or half of a UTF-16 surrogate pair): write it as UTF-8 text",
    ),
    "eval output_json with a NUL": (
        "eval", '{"model_name_or_path": "m", "output_json": "res\\u0000.json"}',
        "argument --output_json/--output-json: 'res\\x00.json' holds a NUL byte (\\u0000)",
    ),
    "taper output_dir with a NUL": (
        "taper", '{"output_dir": "runs/t\\u0000x"}',
        "argument --output_dir/--output-dir: 'runs/t\\x00x' holds a NUL byte",
    ),
    "push include with a NUL": (
        "push", '{"export_dir": "e", "repo_id": "me/x", "include": ["a\\u0000"]}',
        "argument --include: 'a\\x00' holds a NUL byte (\\u0000), which no path or option value can hold",
    ),
    "push include with a null item": (
        "push", "export_dir: e\nrepo_id: me/x\ninclude: [null]\n",
        "include holds an empty item (null): remove it, or write the value",
    ),
    "taper keep_norms with a null item": (
        "taper", '{"keep_norms": ["model.norm", null]}',
        "keep_norms holds an empty item (null): remove it, or write the value",
    ),
    "fold tolerance .inf": (
        "fold", "checkpoint: c\noutput_dir: o\ntolerance: .inf\n",
        "argument --tolerance: must be a finite number, got inf (see hf-tapernorm fold --help)",
    ),
    "fold tolerance .nan": (
        "fold", "checkpoint: c\noutput_dir: o\ntolerance: .nan\n",
        "argument --tolerance: must be a finite number, got nan (see hf-tapernorm fold --help)",
    ),
    "bench learning_rate .inf": (
        "bench", "learning_rate: .inf\n",
        "argument --learning_rate/--learning-rate: must be a finite number, got inf (see hf-tapernorm bench --help)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_an_options_file_the_parse_cannot_take_is_one_line(name, tmp_path, monkeypatch):
    """Each was a traceback (RecursionError; ValueError: embedded null byte; UnicodeEncodeError: surrogates not
    allowed) or, for a non-finite number, an error only once the model had loaded."""
    monkeypatch.chdir(tmp_path)
    command, text, expected = UNREADABLE[name]
    path = tmp_path / ("run.json" if text.startswith("{") else "run.yaml")
    path.write_text(text)
    status, _, stderr = run_main([command, str(path)])
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f"hf-tapernorm {command}: error: {path}: {expected}"), lines[0]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing written


#: a number option's YAML 1.1 spelling -> what its flag reads (an int) or the start of the refusal it gets
YAML_NUMBERS = {
    "max_steps: 010": 10,  # YAML 1.1: octal 8
    "block_size: 0100": 100,  # octal 64
    "seed: 1:30": "seed must be a number, got '1:30'",  # sexagesimal 90
    "save_steps: 0b11": "save_steps must be a number, got '0b11'",  # binary 3
}


@pytest.mark.parametrize("line", list(YAML_NUMBERS))
def test_a_number_option_reads_the_yaml_text_as_its_flag_does(line, tmp_path):
    """They were YAML 1.1's numbers: `max_steps: 010` trained 8 steps, `seed: 1:30` seeded 90."""
    key, text = line.split(": ")
    (tmp_path / "run.yaml").write_text(f"{line}\n")
    expected = YAML_NUMBERS[line]
    if isinstance(expected, int):
        assert parsed("taper", [str(tmp_path / "run.yaml")]) == parsed("taper", [f"--{key}", text])
        values = {k: v for options in parsed("taper", [f"--{key}", text]) for k, v in vars(options).items()}
        assert values[key] == expected
        return
    with pytest.raises(UsageError, match=f"run.yaml: {expected}"):
        parsed("taper", [str(tmp_path / "run.yaml")])
    with pytest.raises(UsageError, match=f"--{key}"):  # refused on the command line too
        parsed("taper", [f"--{key}", text])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("output_dir: |\n  runs/multi\n", "'runs/multi\\n' holds a line break ('\\n')"),
        ("output_dir: >\n  runs/multi\n", "'runs/multi\\n' holds a line break ('\\n')"),
        ('dataset_name: "a\\nb"\n', "'a\\nb' holds a line break ('\\n'), which a path or name cannot hold"),
        ("output_dir: !!binary cnVucy94\n", "output_dir takes text, got binary data"),
    ],
)
def test_a_text_option_with_a_line_break_or_binary_data_is_refused(text, expected, tmp_path, monkeypatch):
    """`fold` exported into a folder whose name ends with a newline, and `!!binary` into the folder "b'runs/x'"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.yaml").write_text("checkpoint: c\n" + text.replace("dataset_name", "output_dir"))
    status, _, stderr = run_main(["fold", str(tmp_path / "f.yaml")])
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f"hf-tapernorm fold: error: {tmp_path / 'f.yaml'}: "), lines[0]
    assert "output_dir" in lines[0] and expected in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.yaml"]  # nothing written
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(UsageError, match=re.escape(expected)):
        parsed("taper", [str(tmp_path / "run.yaml")])


#: name -> (command, a YAML options file's line, the refusal after "{file}: "): a value of a YAML type no option takes
YAML_TYPES = {
    "eval output_json: !!set": (
        "eval", "output_json: !!set {result.json: null}", "output_json takes text, got a set (!!set), which no option "
        "takes: write it as text, a number, true or false, a list or an object",
    ),
    "taper keep_norms: !!set": (
        "taper", "keep_norms: !!set {model.norm: null, model.layers.0.input_layernorm: null}",
        "keep_norms takes text, got a set (!!set), which no option takes",
    ),
    "taper report_to: [!!set]": ("taper", "report_to: [!!set {none: null}]", "report_to takes "),
    "taper lr_scheduler_kwargs: !!omap": (
        "taper", "lr_scheduler_kwargs: !!omap [{min_lr_rate: 0.1}]",
        "lr_scheduler_kwargs takes an object or text, got ordered pairs (!!omap or !!pairs), which no option takes",
    ),
    "taper lr_scheduler_kwargs holding a !!timestamp": (
        "taper", "lr_scheduler_kwargs: {min_lr_rate: !!timestamp 2024-01-01}",
        "lr_scheduler_kwargs takes an object or text, got a date (!!timestamp), which no option takes",
    ),
    "taper use_cpu: !!timestamp": ("taper", "use_cpu: !!timestamp 2024-01-01 10:00:00", "use_cpu takes "),
    "taper learning_rate: !!binary": (
        "taper", "learning_rate: !!binary aGVsbG8=", "learning_rate takes a number, got binary data (!!binary)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(YAML_TYPES))
def test_a_yaml_type_no_option_takes_is_refused_naming_the_file_and_option(name, tmp_path, monkeypatch):
    """A value of a YAML type that is no text, number, bool, list or object became str(value): eval wrote its result
    to a file named {'result.json'}, keep_norms was the patterns "{'model.norm'" and "...'}", and a date or a set inside
    an object option was a TypeError traceback. Each is refused in one line naming the file and the option; nothing is
    written."""
    monkeypatch.chdir(tmp_path)
    command, line, expected = YAML_TYPES[name]
    path = tmp_path / "run.yaml"
    path.write_text(f"model_name_or_path: m\n{line}\n")
    status, _, stderr = run_main([command, str(path)])
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f"hf-tapernorm {command}: error: {path}: {expected}"), lines[0]
    assert "which no option takes" in lines[0]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _enum_options(classes: list[type]) -> list[str]:
    """The fields that a class of ``classes``, or one it derives from, declares as an Enum (``optim``, and
    ``lr_scheduler_type``, which TaperTrainingArguments redeclares as text)."""
    found = []
    for cls in classes:
        for base in cls.__mro__:
            if dataclasses.is_dataclass(base):
                hints = typing.get_type_hints(base)
                for name in vars(base).get("__annotations__", {}):
                    members = typing.get_args(hints[name]) or (hints[name],)
                    if any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
                        found.append(name)
    return sorted(set(found))


ENUM_OPTIONS = [(command, name) for command, classes in COMMANDS.items() for name in _enum_options(classes)]


@pytest.mark.parametrize(("command", "name"), ENUM_OPTIONS)
def test_every_enum_option_refuses_a_bad_choice_naming_the_option(command, name, tmp_path):
    """`--lr_scheduler_type COSINE` (flag or file) was "COSINE is not a valid SchedulerType, please select one of
    [...]", naming no option and no file: TaperTrainingArguments redeclares the field as text, so the parser gave it
    no choices and TrainingArguments refused it after the parse. Every option a class declares as an Enum is now
    refused as argparse refuses a choice, naming the option (and the options file it came from)."""
    assert ("taper", "lr_scheduler_type") in ENUM_OPTIONS and ("taper", "optim") in ENUM_OPTIONS
    flags = f"--{name}" + (f"/--{name.replace('_', '-')}" if "_" in name else "")
    refusal = f"argument {flags}: invalid choice: 'BOGUS' (choose from "
    with pytest.raises(UsageError, match=re.escape(refusal)):
        parsed(command, [f"--{name}", "BOGUS"])
    (tmp_path / "run.yaml").write_text(f"{name}: BOGUS\n")
    with pytest.raises(UsageError, match=re.escape(f"run.yaml: {refusal}")):
        parsed(command, [str(tmp_path / "run.yaml")])


# ============================================================================= a value is a value, whatever it holds
#: name -> (command, a YAML options file, {option: its value once parsed}); each item of a list is a value of its
#: option, whatever its first character, and goes through that option's type and checks
LIST_ITEMS = {
    "include: [*.md, --no_private]": (
        "push", "include: ['*.md', '--no_private']\n", {"include": ["*.md", "--no_private"], "private": True},
    ),
    "include: [*.md, --repo_id=other/repo]": (
        "push", "include: ['*.md', '--repo_id=other/repo']\n", {"include": ["*.md", "--repo_id=other/repo"]},
    ),
    "include: [-notes.txt]": ("push", "include: ['-notes.txt']\n", {"include": ["-notes.txt"]}),
    "a one-value option that starts with -": ("push", "repo_id: -x\n", "'-x' is not a valid Hub repository name"),
    "an int list item that is a flag": (
        "bench", "seq_lens: [8, '--output_dir=elsewhere']\n", "seq_lens must be a number, got '--output_dir=elsewhere'",
    ),
    "a list item that is the end of the options": ("push", "include: ['*.md', '--']\n", "--include=--"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LIST_ITEMS))
def test_a_list_item_that_starts_with_a_dash_is_a_value_of_its_option(name, tmp_path, monkeypatch):
    """Each item was its own command-line word: `--no_private` made the repository public, `--repo_id=other/repo`
    pushed to another repository, and `-notes.txt` was "expected at least one argument"."""
    monkeypatch.chdir(tmp_path)  # bench checks its output folder
    command, text, expected = LIST_ITEMS[name]
    own_repo = "" if text.startswith("repo_id:") else "repo_id: me/x\n"  # a key is given once
    (tmp_path / "run.yaml").write_text((f"export_dir: e\n{own_repo}" if command == "push" else "") + text)
    if isinstance(expected, str):
        with pytest.raises(ConfigurationError, match=re.escape(expected)):
            parsed(command, [str(tmp_path / "run.yaml")])
        assert not (tmp_path / "elsewhere").exists()
        return
    values = {k: v for options in parsed(command, [str(tmp_path / "run.yaml")]) for k, v in vars(options).items()}
    assert {k: values[k] for k in expected} == expected
    assert values["repo_id"] == "me/x"


def test_a_dash_pattern_on_the_command_line_is_given_with_an_equals_sign(tmp_path):
    """What argparse allows: `--include=-notes.txt` is one value; `--include -notes.txt` is a flag (refused)."""
    (tmp_path / "p.yaml").write_text("export_dir: e\nrepo_id: me/x\ninclude: ['-notes.txt']\n")
    argv = ["--export_dir", "e", "--repo_id", "me/x"]
    assert parsed("push", [*argv, "--include=-notes.txt"]) == parsed("push", [str(tmp_path / "p.yaml")])
    with pytest.raises(UsageError, match="expected at least one argument"):
        parsed("push", [*argv, "--include", "-notes.txt"])
    with pytest.raises(UsageError, match="--output_dir=--: '--' is no value an option can take"):  # was a traceback
        parsed("fold", ["--checkpoint", "c", "--output_dir=--"])


def test_a_list_option_given_twice_adds_up_from_either_source(tmp_path):
    """argparse's `store` kept the last: `push --include a --include b` uploaded b's files alone, without a word."""
    argv = ["--export_dir", "e", "--repo_id", "me/x"]
    (push,) = parsed("push", [*argv, "--include", "notes.md", "--include", "extra/*.json", "more.txt"])
    assert push.include == ["notes.md", "extra/*.json", "more.txt"]
    (push,) = parsed("push", [*argv, "--include", "notes.md"])  # once: in place of the default, not beside it
    assert push.include == ["notes.md"]
    (bench,) = parsed("bench", ["--model_name_or_path", "m", "--seq_lens", "64", "--seq_lens", "256"])
    (bench_default,) = parsed("bench", ["--model_name_or_path", "m"])
    assert bench.seq_lens == [64, 256] and bench_default.seq_lens == [128]
    file = write_options(tmp_path, "b.json", {"model_name_or_path": "m", "seq_lens": [64, 256]})
    assert parsed("bench", [str(file)]) == (bench,)
    with pytest.raises(UsageError, match="invalid int value: 'x'"):  # each time through the option's type
        parsed("bench", ["--model_name_or_path", "m", "--seq_lens", "64", "--seq_lens", "x"])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [("{num_decay_steps: 010}", {"num_decay_steps": 10}), ("{num_decay_steps: 1:30}", {"num_decay_steps": "1:30"})],
)
def test_a_number_inside_an_object_option_reads_as_written(kwargs, expected, tmp_path):
    """YAML 1.1 read `010` as octal 8 and `1:30` as 90 (base 60) inside lr_scheduler_kwargs; the flag's JSON text
    cannot hold either, and the top-level number options already read them as written."""
    (tmp_path / "run.yaml").write_text(f"lr_scheduler_kwargs: {kwargs}\n")
    assert parsed("taper", [str(tmp_path / "run.yaml")])[-1].lr_scheduler_kwargs == expected
    assert parsed("taper", ["--lr_scheduler_kwargs", json.dumps(expected)])[-1].lr_scheduler_kwargs == expected


@pytest.mark.parametrize("space", [" ", "\t", "\n"])
def test_an_object_option_after_white_space_reaches_the_trainer(space, tmp_path):
    """`--lr_scheduler_kwargs ' {"num_decay_steps": 3}'` (on the command line or in an options file) passed the JSON
    check, then TrainingArguments, which json-loads only a text that starts with `{`, dropped it: the run decayed
    over the default steps. The stripped text is handed on, so the run's arguments hold the object."""
    text = f'{space}{{"num_decay_steps": 3}}'
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"lr_scheduler_kwargs": text}))
    for argv in (["--lr_scheduler_kwargs", text], [str(tmp_path / "run.yaml")]):
        assert parsed("taper", argv)[-1].lr_scheduler_kwargs == {"num_decay_steps": 3}


@pytest.mark.parametrize("character", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\r\n"])
def test_a_text_option_with_any_line_break_is_refused(character, tmp_path):
    """Only \\n and \\r were refused: a folder name holding U+2028 or NEL (where str.splitlines breaks) was made."""
    (tmp_path / "run.json").write_text(json.dumps({"output_dir": f"runs/a{character}b"}))
    with pytest.raises(UsageError, match=r"run.json: argument --output_dir.*holds a line break"):
        parsed("taper", [str(tmp_path / "run.json")])
    with pytest.raises(UsageError, match=r"^argument --output_dir.*holds a line break"):  # the same on argv
        parsed("taper", ["--output_dir", f"runs/a{character}b"])
    assert parsed("taper", ["--lr_scheduler_kwargs", '{\n"min_lr": 0.0}'])[-1].lr_scheduler_kwargs == {"min_lr": 0.0}


def test_a_json_number_for_a_text_option_is_refused_as_written(tmp_path):
    """`{"output_dir": 1e1, "run_name": 1.50}` trained into the folder 10.0 as the run 1.5."""
    (tmp_path / "run.json").write_text('{"output_dir": 1e1, "run_name": 1.50}')
    expected = r'run.json: output_dir takes text, got the number 1e1; write it as text: "1e1"'
    with pytest.raises(UsageError, match=expected):
        parsed("taper", [str(tmp_path / "run.json")])
    (tmp_path / "run.json").write_text('{"run_name": 1.50}')
    with pytest.raises(UsageError, match=r'run_name takes text, got the number 1.50; write it as text: "1.50"'):
        parsed("taper", [str(tmp_path / "run.json")])
    (tmp_path / "run.yaml").write_text("output_dir: 1e1\nrun_name: 1.50\nmax_steps: 1e1\n")  # YAML: kept as written
    training = parsed("taper", [str(tmp_path / "run.yaml")])[-1]
    assert (training.output_dir, training.run_name, training.max_steps) == ("1e1", "1.50", 10)


def test_a_fifo_as_the_options_file_is_named_as_such(tmp_path):
    """It was "not found"; it is never opened (a pipe nobody writes would block)."""
    os.mkfifo(tmp_path / "run.json")
    line = error_of(["fold", str(tmp_path / "run.json")])
    assert line == (
        f"hf-tapernorm fold: error: options file '{tmp_path / 'run.json'}' is not a regular file (a pipe, a socket "
        "or a device); name a JSON or YAML file of options"
    )


def test_a_flag_value_that_names_an_existing_json_file_is_a_value(tmp_path):
    """Only an options file out of place is refused: `--output_json results.json` (a file an earlier eval wrote)
    is the option's value."""
    (tmp_path / "results.json").write_text("{}")
    argv = ["--model_name_or_path", "m", "--output_json", str(tmp_path / "results.json")]
    assert parsed("eval", argv)[-1].output_json == str(tmp_path / "results.json")
    with pytest.raises(UsageError, match="results.json is read alone, as the first and only argument: put --sink"):
        parsed("eval", ["--sink", "bos", str(tmp_path / "results.json")])


@pytest.mark.parametrize(
    ("command", "values"),
    [("bench", {"seq_lens": [8], "seq-lens": [16]}), ("push", {**PUSH, "private": True, "no_private": True})],
)
def test_two_keys_of_one_option_are_refused(command, values, tmp_path):
    """A list given under both spellings would add up now that each item is its own value; one value would win."""
    first, second = list(values)[-2:]
    with pytest.raises(UsageError, match=f"run.json: {first} and {second} are the same option: keep one"):
        parsed(command, [str(write_options(tmp_path, "run.json", values))])


def test_a_file_beside_the_running_script_is_never_read_as_options(tmp_path, monkeypatch):
    """transformers' parser reads ``<script>.args`` beside ``sys.argv[0]`` unless told not to: a file named like the
    script that runs ``hf_tapernorm.cli.main`` would have set options no one passed."""
    (tmp_path / "convert.args").write_text("--max_steps 3 --output_dir elsewhere")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "convert.py")])
    values = {k: v for options in parsed("taper", ["--output_dir", "runs/x"]) for k, v in vars(options).items()}
    assert values["output_dir"] == "runs/x" and values["max_steps"] != 3


#: command -> the object of a small options file it reads
SMALL_OPTIONS = {
    "taper": {"output_dir": "runs/x"},
    "eval": {"model_name_or_path": "m"},
    "fold": {"checkpoint": "c", "output_dir": "o"},
    "push": PUSH,
    "bench": {"output_dir": "runs/b"},
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_options_file_named_from_the_home_folder_is_read(command, tmp_path, monkeypatch):
    """`taper '~/run.json'` (quoted, or from a script, where no shell expands it) was "options file '~/run.json' not
    found" though it was in $HOME. A ~user this machine does not have is one line."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    write_options(tmp_path / "home", "run.json", SMALL_OPTIONS[command])
    monkeypatch.chdir(tmp_path)  # no run.json here: only $HOME has one
    assert parsed(command, ["~/run.json"]) == parsed(command, [str(tmp_path / "home" / "run.json")])
    with pytest.raises(ConfigurationError, match="'~nosuchuser/run.json': there is no user 'nosuchuser'"):
        parsed(command, ["~nosuchuser/run.json"])


def test_an_options_file_from_the_home_folder_after_a_flag_is_refused_as_out_of_place(tmp_path, monkeypatch):
    """The file is read alone: after a flag it was taken for that flag's value or an extra word, as any other."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_options(tmp_path, "run.json", SMALL_OPTIONS["taper"])
    with pytest.raises(UsageError, match="the options file ~/run.json is read alone, as the first and only argument"):
        parsed("taper", ["--resume", "~/run.json"])


def test_a_commit_message_may_run_over_several_lines_from_either_source(tmp_path):
    """A commit message is prose, not a path or name: its body (after a line break) was refused in push's options
    file and on argv alike."""
    (tmp_path / "push.yaml").write_text("export_dir: e\nrepo_id: me/x\ncommit_message: |\n  Title\n\n  Body line\n")
    (options,) = parsed("push", [str(tmp_path / "push.yaml")])
    assert options.commit_message == "Title\n\nBody line"  # its trailing line break stripped, as git strips it
    argv = ["--export_dir", "e", "--repo_id", "me/x", "--commit_message", "Title\n\nBody line\n"]
    assert parsed("push", argv) == (options,)
    with pytest.raises(UsageError, match=r"argument --export_dir.*holds a line break"):  # a path keeps the rule
        parsed("push", ["--export_dir", "e\n", "--repo_id", "me/x"])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("run.json", '{"block_size": 16, "block_size": 32}'),
        ("run.yaml", "block_size: 16\nblock_size: 32\n"),
        ("run.json", '{"lr_scheduler_kwargs": {"num_decay_steps": 3, "num_decay_steps": 4}}'),
        ("run.yaml", "lr_scheduler_kwargs:\n  num_decay_steps: 3\n  num_decay_steps: 4\n"),
    ],
)
def test_a_key_given_twice_in_one_file_is_refused(name, text, tmp_path):
    """JSON and YAML parsers keep the last of a key given twice without a word: the file ran with block_size 32."""
    (tmp_path / name).write_text(text)
    key = "block_size" if "block_size" in text else "num_decay_steps"
    with pytest.raises(UsageError, match=f"{name}: cannot read it \\(the key '{key}' is given twice in one object"):
        parsed("taper", [str(tmp_path / name)])


@pytest.mark.parametrize(
    "text",
    [
        "<<: {block_size: 16}\n<<: {block_size: 32}\n",
        "<<: [{block_size: 16}, {block_size: 32}]\n",
        "<<: [&small {block_size: 16}, {block_size: 32, max_steps: 4}]\n",
        "<<: [{block_size: 16}, {<<: {block_size: 32}, max_steps: 4}]\n",
        "lr_scheduler_kwargs:\n  <<: [{num_decay_steps: 3}, {num_decay_steps: 4}]\n",
    ],
)
def test_a_key_two_yaml_merges_bring_in_is_refused(text, tmp_path):
    """Two merges (two << keys, or a list after one) giving one key ran with the last one's value, without a word
    (block_size 32), where YAML's merge keeps the first: which one the file means is unclear."""
    (tmp_path / "run.yaml").write_text(text)
    key = "block_size" if "block_size" in text else "num_decay_steps"
    with pytest.raises(
        UsageError, match=f"run.yaml: cannot read it \\(the key '{key}' is given by two merges \\(<<\\) into one object"
    ):
        parsed("taper", [str(tmp_path / "run.yaml")])


def test_a_key_a_yaml_merge_brings_in_may_be_given_again(tmp_path):
    """A merge key (<<) brings defaults in that the mapping's own keys override: YAML's way, not a repeated key."""
    (tmp_path / "run.yaml").write_text(
        "lr_scheduler_kwargs:\n  <<: {num_decay_steps: 3, min_lr_ratio: 0.1}\n  num_decay_steps: 4\n"
    )
    training = parsed("taper", [str(tmp_path / "run.yaml")])[-1]
    assert training.lr_scheduler_kwargs == {"num_decay_steps": 4, "min_lr_ratio": 0.1}


def _alias_levels(levels: int) -> str:
    """An options file whose lr_scheduler_kwargs nest YAML aliases ``levels`` deep: 10**(levels + 1) items, built
    from a few hundred bytes (``a1: &a1 [*a0, *a0, ...]``)."""
    lines = ["lr_scheduler_kwargs:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nmax_steps: 6\n"


def test_yaml_aliases_that_expand_past_any_options_need_are_refused_before_they_expand(tmp_path):
    """A 587-byte file nesting aliases 8 levels deep expanded 10**8 items: no message, a hang until memory ran
    out. An expansion past what any command's options hold is refused at once, in one line naming the file, before
    anything is built (counted on the shared nodes, so the count is quick); a few aliases read as before."""
    (tmp_path / "bomb.yaml").write_text(_alias_levels(8))
    with pytest.raises(UsageError) as refused:
        parsed("taper", [str(tmp_path / "bomb.yaml")])
    assert str(refused.value) == (
        f"{tmp_path / 'bomb.yaml'}: cannot read it (its YAML aliases (*name) expand to more than 10000 values, more "
        "than any command's options hold: write the values out, or alias fewer)"
    )
    (tmp_path / "few.yaml").write_text(_alias_levels(1))
    assert len(parsed("taper", [str(tmp_path / "few.yaml")])[-1].lr_scheduler_kwargs["a1"]) == 10
    (tmp_path / "alias.yaml").write_text("max_steps: &steps 6\nsave_steps: *steps\n")
    training = parsed("taper", [str(tmp_path / "alias.yaml")])[-1]
    assert (training.max_steps, training.save_steps) == (6, 6)


@pytest.mark.parametrize(
    ("command", "text", "option"),
    [
        ("taper", "output_dir: ~\n", "output_dir"),
        ("taper", "data_cache_dir: ~\nsink: ~\n", "data_cache_dir"),
        ("taper", "baseline_from: ~\n", "baseline_from"),
        ("eval", "output_json: ~\n", "output_json"),
        ("bench", "output_dir: ~\n", "output_dir"),
        ("bench", "dataset-name: ~\n", "dataset_name"),
    ],
)
def test_a_path_option_written_as_a_bare_yaml_tilde_is_refused(command, text, option, tmp_path):
    """``output_dir: ~`` (the user's home folder) is YAML's null, the option's default: the run went to ./runs/taper
    without a word. A path option given a bare ~ is now refused, saying how to write either meaning."""
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(ConfigurationError) as refused:
        parsed(command, [str(tmp_path / "run.yaml")])
    assert str(refused.value) == (
        f"{tmp_path / 'run.yaml'}: {option}: ~ is YAML's null, which leaves --{option} at its default, not the home "
        f"folder: write '~' (quoted) for the home folder, or leave {option} out for the default"
    )


@pytest.mark.parametrize(
    "command, text, option",
    [
        ("fold", "checkpoint: ~\noutput_dir: out\n", "checkpoint"),
        ("fold", "checkpoint: run/tapered\noutput_dir: ~\n", "output_dir"),
        ("push", "export_dir: ~\nrepo_id: me/x\n", "export_dir"),
    ],
)
def test_a_required_option_written_as_a_bare_yaml_tilde_is_refused_as_written(command, text, option, tmp_path):
    """A required path option given a bare ~ (YAML's null: no value) was refused as if the file had left it out
    ("the following arguments are required: --output_dir"); the refusal now says what the file wrote and how to write
    the home folder."""
    (tmp_path / "run.yaml").write_text(text)
    assert error_of([command, str(tmp_path / "run.yaml")]) == (
        f"hf-tapernorm {command}: error: {tmp_path / 'run.yaml'}: {option}: ~ is YAML's null, so the required "
        f"--{option} has no value: write '~' (quoted) if you meant the home folder"
    )


def test_null_and_a_bare_tilde_for_other_options_are_still_the_default(tmp_path):
    """``null`` (and an empty value) leave any option at its default, as documented, and so does a bare ~ for an
    option that is no path."""
    (tmp_path / "run.yaml").write_text("output_dir: null\ndata_cache_dir:\nsink: ~\nlr_scheduler_type: ~\n")
    *_, training = parsed("taper", [str(tmp_path / "run.yaml")])
    assert (training.output_dir, training.lr_scheduler_type) == ("runs/taper", "warmup_stable_decay")


def test_one_dtype_spelling_serves_every_command_and_load_export(tmp_path, monkeypatch):
    """bench took fp32/bf16/fp16 only ("--dtypes: 'float32' not among fp32, bf16, fp16") while eval's --dtype and
    load_export took float32/bfloat16/float16 only, so no options file held a dtype both read. Now every place that
    takes a dtype by name reads both spellings (utils.read_dtype), keeping its own in what it records."""
    import torch

    from hf_tapernorm.utils import load_dtype

    monkeypatch.chdir(tmp_path)  # bench checks its default output folder
    for long, short in (("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")):
        (bench,) = parsed("bench", [str(write_options(tmp_path, "b.json", {"dtypes": [long]}))])
        assert bench.dtypes == [short]  # bench.json keeps the short name
        model = parsed("eval", [str(write_options(tmp_path, "e.yaml", {"dtype": short}))])[0]
        assert model.dtype == long  # eval's results and a run's identity keep torch's name
        assert load_dtype(short, "an export") is load_dtype(long, "an export") is getattr(torch, long)
    with pytest.raises(ConfigurationError) as refused:
        parsed("bench", [str(write_options(tmp_path, "b.json", {"dtypes": ["float64"]}))])
    assert str(refused.value) == (
        "--dtypes: 'float64' is none of its dtypes: give one of float32/fp32, bfloat16/bf16, float16/fp16"
    )


def test_a_relative_path_of_an_options_file_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """A relative path in an options file is read from the working folder (the file reads as the same flags), but
    its refusal ("--dataset_name 'corpus.txt' not found") named neither the file nor the folder searched, so a
    user who kept the file beside its data could not tell why. Now the refusal says both, in one place (the CLI's
    error handler); the same path given as a flag is refused as before."""
    files, work = tmp_path / "files", tmp_path / "work"
    files.mkdir(), work.mkdir()
    (files / "corpus.txt").write_text("text\n")
    monkeypatch.chdir(work)
    options = write_options(files, "e1.yaml", {"model_name_or_path": "../model", "dataset_name": "corpus.txt"})
    assert error_of(["eval", str(options)]) == (
        f"hf-tapernorm eval: error: --dataset_name 'corpus.txt' (from {options}) not found in the working folder "
        f"{work}: no such file or folder; paths in an options file are read from the working folder, not the "
        f"file's ({files}): write them from the working folder, or as absolute paths"
    )
    fold = write_options(files, "f1.yaml", {"checkpoint": "../run/tapered", "output_dir": "out"})
    assert error_of(["fold", str(fold)]) == (
        f"hf-tapernorm fold: error: model '../run/tapered' (--checkpoint in {fold}) not found in the working folder "
        f"{work}: no such folder or file; paths in an options file are read from the working folder, not the "
        f"file's ({files}): write them from the working folder, or as absolute paths"
    )
    assert error_of(["eval", "--model_name_or_path", "../model", "--dataset_name", "corpus.txt"]) == (
        "hf-tapernorm eval: error: --dataset_name 'corpus.txt' not found: no such file or folder"
    )


def _hint(name: Path, work: Path, files: Path) -> str:
    """What a refusal that quotes a relative path from the options file ``name`` says of it after its own words."""
    return (
        f"came from {name}: paths in an options file are read from the working folder ({work}), not the file's "
        f"({files}): write them from the working folder, or as absolute paths"
    )


def test_a_relative_path_of_an_options_file_is_hinted_however_its_refusal_reads(tmp_path, monkeypatch):
    """The hint was given only where a refusal read "'X' not found": fold's "--checkpoint 'myrun/tapered': no such
    folder" (a path with a space or a quote too) and push's "'nothere' is not a folded export" (a missing folder)
    named neither the file nor the working folder. Now a refusal that quotes a relative path a path option of the
    file gave, missing from the working folder, says so after its own words ("'X' not found" is reworded as before).
    A path that exists, and a value of an option that is no path (push's --repo_id), get no hint."""
    files, work = tmp_path / "files", tmp_path / "work"
    files.mkdir(), work.mkdir()
    monkeypatch.chdir(work)
    for checkpoint in ("myrun/tapered", "my run/it's tapered"):
        fold = write_options(files, "f.yaml", {"checkpoint": checkpoint, "output_dir": "out"})
        assert error_of(["fold", str(fold)]) == (
            f"hf-tapernorm fold: error: --checkpoint '{checkpoint}': no such folder; fold reads a local tapered "
            f"checkpoint; '{checkpoint}' {_hint(fold, work, files)}"
        )
    push = write_options(files, "p.yaml", {"export_dir": "nothere", "repo_id": "me/x"})
    assert error_of(["push", str(push)]) == (
        f"hf-tapernorm push: error: --export_dir 'nothere' (from {push}) not found in the working folder {work}: no "
        "such folder; name the folded export taper or fold wrote; paths in an options file are read from the "
        f"working folder, not the file's ({files}): write them from the working folder, or as absolute paths"
    )
    (work / "plain").mkdir()  # exists: whatever is wrong with it, it was found
    fold = write_options(files, "f.yaml", {"checkpoint": "plain", "output_dir": "out"})
    assert "came from" not in error_of(["fold", str(fold)])
    (work / "e").mkdir()
    push = write_options(files, "p.yaml", {"export_dir": "e", "repo_id": "me/a..b"})
    assert error_of(["push", str(push)]).startswith("hf-tapernorm push: error: --repo_id 'me/a..b' is not a valid")
    assert "came from" not in error_of(["push", str(push)])


def test_a_model_path_of_an_options_file_taken_as_a_hub_id_is_hinted(tmp_path, monkeypatch):
    """eval of a file's ``model_name_or_path: myrun/folded`` (a path written from the file's folder) was refused as
    a Hub id, "no local folder of that name, so it was taken as a Hub id", without a word of the file. Now it says
    that the name came from the file and where paths in it are read from (true of a Hub id too)."""
    files, work = tmp_path / "files", tmp_path / "work"
    files.mkdir(), work.mkdir()
    (work / "corpus.txt").write_text("some text\n" * 20)
    monkeypatch.chdir(work)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no network retries for the Hub id
    options = write_options(files, "e.yaml", {"model_name_or_path": "myrun/folded", "dataset_name": "corpus.txt"})
    message = error_of(["eval", str(options)])
    assert "cannot load a tokenizer from 'myrun/folded' (no local folder of that name, so it was taken as a Hub id" in (
        message
    )
    assert message.endswith(f"; --model_name_or_path 'myrun/folded' {_hint(options, work, files)}")


def test_the_options_file_path_hint_speaks_only_of_path_options():
    """The hint is limited to PATH_OPTIONS, the options whose values are paths: every option that a command's
    arguments check as a path (utils.expand_user_options) is one of them, so that a new path option is not left out."""
    import ast

    from hf_tapernorm._options_file import PATH_OPTIONS

    checked = set()
    for source in Path("hf_tapernorm").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "expand_user_options":
                checked |= {arg.value for arg in node.args[1:] if isinstance(arg, ast.Constant)}
    assert checked == PATH_OPTIONS


def test_dtype_takes_every_spelling_read_dtype_reads(tmp_path):
    """eval/taper --dtype torch.float32 was argparse's "invalid choice" (its choices listed seven names) while bench
    --dtypes and load_export took it (utils.read_dtype). Now --dtype reads every spelling read_dtype reads, or auto,
    and keeps torch's name (a run's identity, eval's results); anything else is one line naming --dtype, from the
    command line or a file, at parse time."""
    for given, kept in (("torch.float32", "float32"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16")):
        assert parsed("eval", ["--dtype", given])[0].dtype == kept
        options = write_options(tmp_path, "t.yaml", {"dtype": given, "max_steps": 4})
        assert parsed("taper", [str(options)])[0].dtype == kept
    assert parsed("eval", ["--dtype", "auto"])[0].dtype == "auto"
    for bad in ("float64", "FP32", "torch.int8"):
        with pytest.raises(ConfigurationError) as refused:
            parsed("eval", [str(write_options(tmp_path, "e.yaml", {"dtype": bad}))])
        assert str(refused.value) == (
            f"--dtype '{bad}': give one of float32/fp32, bfloat16/bf16, float16/fp16, or auto"
        )
