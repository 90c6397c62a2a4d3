"""The extension point (``TaperExtension``, passed as ``main(argv, extension=...)``): an extension's training data is
what both trainings read, it is recorded in the report, and its options are part of the run's identity."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from transformers import TrainerCallback

from hf_tapernorm import ConfigurationError
from hf_tapernorm.app.report import summary_lines
from hf_tapernorm.app.taper import TaperExtension, TrainingData, TrainingInputs
from hf_tapernorm.cli.main import main
from tests.helpers import error_of, spy_on_trainings, taper_argv


class FirstBlockOnly:
    """A training_data hook that trains on the first packed block, repeated (a change every forward shows), and
    counts the text tokens only (not the sink's)."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[TrainingInputs] = []
        self.refuse = refuse

    def __call__(self, inputs: TrainingInputs) -> TrainingData:
        self.calls.append(inputs)
        if self.refuse:
            raise ConfigurationError("--first_block_only: refused by the hook")
        packed = inputs.packed
        text = inputs.blocks_per_step * (inputs.data.block_size - len(packed.prefix_ids))
        return TrainingData(
            packed.train.select([0] * len(packed.train)),
            facts={"distinct_blocks": 1},
            tokens=lambda steps: steps * text,
        )


def extension_of(hook: FirstBlockOnly, **facts) -> TaperExtension:
    return TaperExtension(training_data=hook, data_facts=facts or {"repeat": "first block"})


def run_with(argv: list[str], extension: TaperExtension) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv, extension=extension)
    return code, out.getvalue(), err.getvalue()


class _Inputs(TrainerCallback):
    """The input ids of every training forward."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, args, kwargs):
            if module.training:
                self.ids.append(kwargs["input_ids"])

        model.register_forward_pre_hook(record, with_kwargs=True)


def test_the_hook_s_data_is_what_both_trainings_read_and_is_recorded(workspace, tmp_path, monkeypatch):
    seen = spy_on_trainings(monkeypatch, _Inputs)
    hook, out = FirstBlockOnly(), tmp_path / "run"
    code, stdout, stderr = run_with(taper_argv(workspace, out, "--baseline"), extension_of(hook))
    assert code == 0, stderr[-3000:]

    (inputs,) = hook.calls
    assert len(inputs.packed.train) == 10 * 2 and inputs.blocks_per_step == 2
    assert inputs.training.max_steps == 10 and inputs.model_config.model_type == "llama"
    first = inputs.packed.train[0]["input_ids"]
    tapered, baseline = seen
    for spy in (tapered, baseline):
        assert len(spy.ids) == 10 and all(bool((ids == first).all()) for ids in spy.ids)

    report = json.loads((out / "report.json").read_text())
    sink = len(report["taper"]["sink_token_ids"])
    assert report["data"]["repeat"] == "first block" and report["data"]["distinct_blocks"] == 1
    assert report["training"]["tokens"] == 10 * 2 * (32 - sink)
    assert "blocks of 32 tokens (repeat first block, distinct_blocks 1)" in stdout
    identity = json.loads((out / ".hf_tapernorm_run.json").read_text())["identity"]
    assert identity["data"]["repeat"] == "first block"

    # another extension's options, or none, make another run: --resume and --baseline_from refuse it
    message = error_of([*taper_argv(workspace, out), "--resume"])
    assert "--resume: these options differ" in message and "data.repeat: 'first block' in the run, None now" in message
    code, _, stderr = run_with([*taper_argv(workspace, out), "--resume"], extension_of(FirstBlockOnly(), repeat="x"))
    assert code == 2 and "data.repeat: 'first block' in the run, 'x' now" in stderr
    message = error_of(taper_argv(workspace, tmp_path / "other", "--baseline_from", str(out)))
    assert "data.repeat: 'first block' there, None now" in message
    assert not (tmp_path / "other").exists()


def test_a_hook_refuses_the_run_in_one_line_before_the_folder_is_touched(workspace, tmp_path, monkeypatch):
    monkeypatch.setattr("hf_tapernorm.app.taper.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    hook, out = FirstBlockOnly(refuse=True), tmp_path / "run"
    code, _, stderr = run_with(taper_argv(workspace, out), extension_of(hook))
    assert code == 2 and len(hook.calls) == 1
    first = next(line for line in stderr.splitlines() if line.startswith("hf-tapernorm "))
    assert first == "hf-tapernorm taper: error: --first_block_only: refused by the hook"
    assert not out.exists()


def test_an_extension_s_options_may_not_rename_the_run_s_own(workspace, tmp_path):
    with pytest.raises(ValueError, match=r"data_facts \['block_size'\] are keys of the run's own data identity"):
        run_with(taper_argv(workspace, tmp_path / "run"), extension_of(FirstBlockOnly(), block_size=64))
    with pytest.raises(ValueError, match="data_facts describe a training_data hook, and there is none"):
        TaperExtension(data_facts={"repeat": "first block"})


def test_the_report_of_an_older_run_with_its_own_data_options_still_reads():
    """Runs of versions that had long steps and position spans as options recorded them in the data section."""
    data = {"source": "corpus.txt", "block_size": 128, "train_blocks": 16, "heldout_tokens": 512}
    older = {"data": {**data, "long_block_size": 512, "long_block_every": 8, "long_train_blocks": 80}}
    assert "blocks of 128 tokens (long_block_size 512, long_block_every 8, long_train_blocks 80)" in "\n".join(
        summary_lines(older)
    )
    unused = {"data": {**data, "long_block_size": None, "long_block_every": None, "position_span": None}}
    assert "data: corpus.txt, blocks of 128 tokens, held-out 512 tokens" in summary_lines(unused)
