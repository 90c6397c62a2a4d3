import logging
import math

import pytest

from hf_tapernorm import ConfigurationError, TaperNormConfig
from hf_tapernorm.training import TaperSchedule


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
