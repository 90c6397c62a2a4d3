import json
import logging
import math
from pathlib import Path

import pytest

from hf_tapernorm import ConfigurationError, TaperNormConfig
from hf_tapernorm._parsing import parse
from hf_tapernorm.app.preflight import check_trainer_options
from hf_tapernorm.app.validation import (
    TaperRequest,
    check_schedule,
    fit_default_schedule,
    fit_default_warmup,
    recipe_config,
    weightless_model,
)
from hf_tapernorm.cli.arguments import (
    DataArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.evaluation.models import load_tokenizer, resolve_model
from hf_tapernorm.training import TaperSchedule
from hf_tapernorm.training.schedule import decay_learning_rate_after_the_taper
from tests.helpers import one_model_workspace, run_main


def _cosine(k, start, end):
    return 0.5 * (1 + math.cos(math.pi * (k - start) / (end - start)))


def test_absolute_steps_boundaries_and_interior():
    schedule = TaperSchedule(10, 30, total_steps=40)
    assert [schedule.gate(k) for k in range(0, 11)] == [1.0] * 11  # exactly 1 up to and including k_start
    assert schedule.gate(11) < 1.0
    assert schedule.gate(20) == pytest.approx(0.5, abs=1e-12)  # midpoint of the cosine
    for k in range(11, 30):
        assert schedule.gate(k) == pytest.approx(_cosine(k, 10, 30), abs=1e-12)
    assert [schedule.gate(k) for k in range(30, 41)] == [0.0] * 11  # exactly 0.0 from k_end on
    gates = [schedule.gate(k) for k in range(1, 41)]
    assert all(a >= b for a, b in zip(gates, gates[1:]))


def test_fractions_resolve_against_the_run_length():
    schedule = TaperSchedule(0.05, 0.7).resolve(200)
    assert (schedule.k_start, schedule.k_end, schedule.total_steps) == (10, 140, 200)
    absolute = TaperSchedule(10, 140, total_steps=200)
    assert [schedule.gate(k) for k in range(1, 201)] == [absolute.gate(k) for k in range(1, 201)]
    assert schedule.gate(10) == 1.0 and schedule.gate(140) == 0.0
    mixed = TaperSchedule(25, 0.5).resolve(300)
    assert (mixed.k_start, mixed.k_end) == (25, 150)


def test_the_default_window_is_the_configs_and_the_papers_recipes_are_plain_schedules():
    assert TaperSchedule() == TaperSchedule.from_config(TaperNormConfig())
    default = TaperSchedule().resolve(1000)
    assert (default.k_start, default.k_end) == (50, 700)
    pretraining = TaperSchedule(0.05, 1.0, total_steps=1000)  # the paper's pre-training recipe
    assert (pretraining.k_start, pretraining.k_end) == (50, 1000)
    assert pretraining.gate(999) > 0.0 and pretraining.gate(1000) == 0.0  # the last step runs at g = 0
    gpt2_small = TaperSchedule(25, 100, total_steps=300)  # the paper's GPT-2 Small fine-tuning
    assert gpt2_small.gate(25) == 1.0 and gpt2_small.gate(100) == 0.0 and gpt2_small.gate(300) == 0.0


def test_invalid_schedules_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"k_start=0, k_end=10, total_steps=20\): k_start must be >= 1"):
        TaperSchedule(0, 10, total_steps=20)
    with pytest.raises(ValueError, match=r"k_start=0, k_end=7, total_steps=10\): k_start must be >= 1.*round to 0"):
        TaperSchedule(0.04, 0.7).resolve(10)  # 4% of 10 steps rounds to 0
    with pytest.raises(ValueError, match=r"k_start=10, k_end=10, total_steps=20\): k_end must be greater"):
        TaperSchedule(10, 10, total_steps=20)
    with pytest.raises(ValueError, match=r"reaches 0 only at step 30, after the run's last step 20; it ends at g = "):
        TaperSchedule(5, 30, total_steps=20)
    with pytest.raises(ValueError, match=r"a float is a fraction of the run and must be in \(0, 1\]"):
        TaperSchedule(5, 30.0)
    with pytest.raises(ConfigurationError, match=r"must be an int"):
        TaperSchedule(True, 30)
    with pytest.raises(ValueError, match=r"has fractional steps; call \.resolve\(total_steps\) first"):
        TaperSchedule(0.1, 0.5).gate(3)


def test_incomplete_schedule_is_a_warning_only_when_asked(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        schedule = TaperSchedule(5, 30, total_steps=20, allow_incomplete=True)
    assert "it ends at g = 0.3455" in caplog.text
    assert schedule.gate(20) == pytest.approx(_cosine(20, 5, 30))


def test_a_schedule_built_for_one_run_length_refuses_another():
    schedule = TaperSchedule(0.1, 0.5, total_steps=100)
    assert schedule.resolve(100) == schedule
    with pytest.raises(ValueError, match=r"built for total_steps=100, but the run has 200 optimizer steps"):
        schedule.resolve(200)


# ============================================================================= the CLI's defaults fit every run length
def test_the_library_fits_the_default_window_to_a_short_run_as_the_cli_does(tmp_path):
    """TaperController(model, total_steps=10) of a config at the default window (5% to 70%) was refused: 5% of 10
    steps rounds to step 0, where the CLI moves its default window to fit. Both take one rule (fit_default_window),
    TaperCallback too; a window set away from the defaults is still refused as set."""
    from types import SimpleNamespace

    from transformers import Trainer, TrainingArguments

    from hf_tapernorm import TaperCallback, TaperController, patch_model
    from tests.conftest import build, tiny_llama_config

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    flags = SimpleNamespace(taper_start=None, taper_end=None)  # the CLI's: no --taper_start, no --taper_end
    for steps in range(2, 130):
        cli = check_schedule(fit_default_schedule(TaperNormConfig.paper(), flags, steps), steps)
        library = TaperController(model, total_steps=steps).schedule
        assert (library.k_start, library.k_end, library.total_steps) == (cli.k_start, cli.k_end, steps), steps
    assert TaperController(model, total_steps=10).schedule.k_start == 1
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=model, args=args, callbacks=[TaperCallback()])  # the callback resolves its schedule here
    chosen = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(taper_start=0.04))
    with pytest.raises(ConfigurationError, match=r"k_start=0, k_end=7, total_steps=10\): k_start must be >= 1"):
        TaperController(chosen, total_steps=10)


TAPER_OPTIONS = [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("schedule"))


def _validate(source, tokenizer, skeleton, *flags: str) -> None:
    """What taper checks before it loads the weights, on these flags (raises what it would refuse)."""
    request = TaperRequest(*parse(TAPER_OPTIONS, ["--use_cpu", *flags], "hf-tapernorm taper"))
    steps = request.training.max_steps
    config = fit_default_schedule(recipe_config(request, skeleton, tokenizer), request.taper, steps)
    schedule = check_schedule(config, steps)
    fit_default_warmup(request.training, schedule)
    decay_learning_rate_after_the_taper(request.training, schedule)
    check_trainer_options(request.training, schedule, config)
    return request, schedule


def test_defaults_agree_for_every_max_steps(ws, caplog):
    source = resolve_model(str(ws / "llama"))
    tokenizer, skeleton = load_tokenizer(source), weightless_model(source, False)
    caplog.set_level(logging.ERROR)
    for steps in [*range(2, 130), 150, 299, 300, 301, 1000, 4096]:
        for recipe in ("auto", "paper"):
            request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", str(steps), "--recipe", recipe)
            assert 1 <= schedule.k_start < schedule.k_end <= steps, steps
            assert request.training.get_warmup_steps(steps) <= schedule.k_start, steps
    request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", "24")
    assert (schedule.k_start, request.training.get_warmup_steps(24)) == (1, 1)
    request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", "300")  # the fractions, untouched
    assert (schedule.k_start, schedule.k_end, request.training.warmup_steps) == (15, 210, 0.05)
    # What the user sets is not moved: an explicit warmup past the taper start is still refused.
    with pytest.raises(ConfigurationError, match="--warmup_steps 5"):
        _validate(source, tokenizer, skeleton, "--max_steps", "24", "--warmup_steps", "5")
    with pytest.raises(ConfigurationError, match="--max_steps must be at least 2"):
        parse(TAPER_OPTIONS, ["--max_steps", "1"], "hf-tapernorm taper")


def test_taper_with_24_steps_and_every_default_runs(ws, tmp_path):
    out = tmp_path / "out"
    arguments = [
        "taper", "--model_name_or_path", str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"), "--block_size",
        "32", "--heldout_blocks", "2", "--heldout_percentage", "10", "--max_steps", "24", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(ws / "cache"), "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", "--per_device_train_batch_size", "1",
    ]  # fmt: skip
    code, _, stderr = run_main(arguments)
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["taper"]["taper_start_step"] == 1 and report["training"]["final_gate"] == 0.0
