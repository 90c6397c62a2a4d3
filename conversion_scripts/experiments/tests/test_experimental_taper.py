"""The experimental options (``TaperNormConfig.experimental``) in a ``taper`` run: experimental_taper.py reads them
and hands them to the command through ``TaperExtension(experimental=...)``; the report and the run's identity
record them, a ``--resume`` with other values is refused, and a bad value is one line naming its flag."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from conversion_scripts.experiments import fidelity_matrix
from conversion_scripts.experiments.experimental_taper import main
from hf_tapernorm import ConfigurationError
from hf_tapernorm.app.taper import TaperExtension
from hf_tapernorm.cli.arguments import (
    DataArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.config import ExperimentalOptions
from tests.conftest import corpus_documents, save_tiny_model
from tests.helpers import run_main, taper_argv


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("experimental")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


def script(argv: list[str]) -> tuple[int, str]:
    """The script in this process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stopped:  # argparse's own errors
            code = stopped.code
    return code, err.getvalue()


def test_distillation_from_the_frozen_original_adds_the_kl_from_the_first_step(workspace):
    """``--distill_from original`` (an experimental teacher: the model before training) against the plain taper:
    the report records it under ``experimental`` and its first steps are the plain run's, then the KL adds up."""
    plain_run, out = workspace / "plain", workspace / "original"
    code, _, stderr = run_main(taper_argv(workspace, plain_run, "--distill_weight", "0"))
    assert code == 0, stderr
    code, stderr = script([*taper_argv(workspace, out, "--distill_weight", "1.0")[1:], "--distill_from", "original"])
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    plain = json.loads((plain_run / "report.json").read_text())
    assert report["taper"]["distill_weight"] == 1.0 and plain["taper"]["distill_weight"] == 0.0
    assert report["taper"]["experimental"] == {"distill_from": "original"} and plain["taper"]["experimental"] == {}
    assert plain["taper"]["distill_until"] is None  # no teacher: nothing to distil until
    losses = [r["loss"] for r in report["history"]]
    # Steps 1-2: student and teacher are the same function (gate 1; the one warmup step has lr 0), so the KL and
    # its gradient are 0 and step 3 starts from the plain run's weights: it adds a positive KL to the same CE.
    assert losses[:2] == pytest.approx([r["loss"] for r in plain["history"][:2]], rel=1e-6)
    assert losses[2] > plain["history"][2]["loss"]
    assert report["heldout"]["folded"]["loss"] == pytest.approx(report["heldout"]["tapered"]["loss"], rel=1e-5)
    saved = json.loads((out / "tapered" / "tapernorm_config.json").read_text())
    assert saved["experimental"] == {"distill_from": "original"}

    # The options are part of the run: resuming it with another teacher (or none) is another run, refused.
    code, _, stderr = run_main([*taper_argv(workspace, out, "--distill_weight", "1.0"), "--resume"])
    assert code == 2 and "taper.experimental.distill_from: 'original' in the run, None now" in stderr


def test_a_bad_experimental_value_is_one_line_naming_its_flag(workspace, tmp_path):
    argv = taper_argv(workspace, tmp_path / "x")[1:]
    code, stderr = script([*argv, "--calibration_scale", "0"])
    assert code == 2 and stderr.strip().splitlines()[-1].endswith(
        "error: --calibration_scale must be positive, got 0.0"
    )
    code, stderr = script([*argv, "--distill_schedule", "fade"])
    assert code == 2 and "argument --distill_schedule: invalid choice: 'fade'" in stderr
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig.experimental has no field 'teacher'"):
        TaperExtension(experimental={"teacher": "original"})


def test_the_harness_runs_every_experimental_arm_through_the_script():
    """An arm that sets an experimental option runs experimental_taper.py; every other arm's flags are options of
    ``taper`` itself (none the product dropped)."""
    research = {f"--{option.name}" for option in dataclasses.fields(ExperimentalOptions)}
    taper = HfArgumentParser([ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments])
    for name, arm in fidelity_matrix.ARMS.items():
        if research & set(arm.flags):
            assert arm.script == fidelity_matrix.EXPERIMENTAL_TAPER, name
        elif arm.script is None:
            taper.parse_args_into_dataclasses(args=list(arm.flags))  # an unknown flag: ValueError naming it
    command = fidelity_matrix.command_for(Path("runs"), 6, "kl_fades_with_gate", 1, (), [])
    assert command[:3] == ["python", "-m", fidelity_matrix.EXPERIMENTAL_TAPER]
    assert command[-4:-2] == ["--distill_schedule", "gate"]
