"""Long training steps (``--long_block_size``): which steps read long blocks, what the Trainer receives, the run's
record, a resumed run, and the options' errors."""

from __future__ import annotations

import json
import os
import signal

import datasets
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import TrainerCallback, default_data_collator

from hf_tapernorm.app.long_blocks import LengthMix, MixedLengthBlocks
from hf_tapernorm.errors import ConfigurationError
from tests.helpers import error_of, run_main, signal_at_step, spy_on_trainings, taper_argv


def _blocks(count: int, length: int, start: int = 0) -> datasets.Dataset:
    """``count`` blocks of ``length`` tokens; block i holds the token ``start + i`` throughout (to tell them apart)."""
    ids = [[start + i] * length for i in range(count)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")


def test_every_nth_step_is_long_and_the_tokens_count_it():
    mix = LengthMix(short_size=32, long_size=128, every=4)
    assert [step for step in range(12) if mix.is_long(step)] == [3, 7, 11]
    assert mix.long_steps(12) == 3 and mix.long_steps(11) == 2
    assert mix.tokens(12, blocks_per_step=2) == 2 * (3 * 128 + 9 * 32)


@pytest.mark.parametrize(
    ("short", "long", "every", "message"),
    [
        (128, 128, 16, "--long_block_size 128 must be longer than --block_size 128 (0 turns the long steps off)"),
        (128, 64, 16, "--long_block_size 64 must be longer than --block_size 128"),
        (128, 1024, 1, "--long_block_every must be at least 2, got 1 (every step long: raise --block_size)"),
    ],
)
def test_a_mix_that_is_none_is_refused(short, long, every, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LengthMix(short, long, every)


def test_each_step_of_the_stream_has_one_length_in_a_seeded_order():
    """Under a DataLoader of the per-device batch, with 2 micro-batches per step (accumulation or processes)."""
    short, long = _blocks(10, 8), _blocks(5, 24, start=100)
    mix = LengthMix(8, 24, every=3)

    def batches(seed: int, count: int) -> list[torch.Tensor]:
        stream = MixedLengthBlocks(short, long, mix, blocks_per_step=4, seed=seed)
        loader = DataLoader(stream, batch_size=2, collate_fn=default_data_collator)
        return [batch["input_ids"] for batch, _ in zip(loader, range(count))]

    read = batches(seed=0, count=18)  # 9 optimizer steps of 2 micro-batches
    lengths = [batch.shape[1] for batch in read]
    assert lengths == [8, 8, 8, 8, 24, 24] * 3
    assert all(batch.shape[0] == 2 for batch in read)
    short_tokens = [int(b[i, 0]) for b in read if b.shape[1] == 8 for i in range(2)]
    assert sorted(short_tokens[:10]) == list(range(10))  # one pass over the short blocks before any repeats
    long_tokens = [int(b[i, 0]) for b in read if b.shape[1] == 24 for i in range(2)]
    assert sorted(long_tokens[:5]) == [100, 101, 102, 103, 104]
    assert all(torch.equal(a, b) for a, b in zip(read, batches(seed=0, count=18)))
    assert not all(torch.equal(a, b) for a, b in zip(read, batches(seed=1, count=18)))


def test_too_few_blocks_for_one_step_are_refused():
    with pytest.raises(ConfigurationError, match="the training set has 1 long blocks, fewer than one step's 2"):
        MixedLengthBlocks(_blocks(4, 8), _blocks(1, 24), LengthMix(8, 24, 3), blocks_per_step=2, seed=0)


class _Lengths(TrainerCallback):
    """The sequence length of every optimizer step's batch, read from the model's forward."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.step_lengths: list[int] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, args, kwargs):
            self.lengths.append(kwargs["input_ids"].shape[1])

        model.register_forward_pre_hook(record, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_lengths.append(self.lengths[-1])


def test_a_taper_run_trains_long_steps_and_records_them(workspace, tmp_path, monkeypatch):
    seen = spy_on_trainings(monkeypatch, _Lengths)
    out = tmp_path / "run"
    argv = taper_argv(workspace, out, "--long_block_size", "64", "--long_block_every", "4", "--baseline")
    code, stdout, stderr = run_main(argv)
    assert code == 0, stderr[-3000:]
    tapered, baseline = seen
    assert tapered.step_lengths == [32, 32, 32, 64, 32, 32, 32, 64, 32, 32]
    assert baseline.step_lengths == tapered.step_lengths  # the baseline reads the same mix
    report = json.loads((out / "report.json").read_text())
    data = report["data"]
    assert (data["long_block_size"], data["long_block_every"], data["long_train_blocks"]) == (64, 4, 4)
    assert data["train_blocks"] == 16  # 8 short steps of 2
    assert report["training"]["tokens"] == 2 * (8 * 32 + 2 * 64)
    assert "blocks of 32 tokens (64 every 4 steps)" in stdout
    assert "blocks of 32 tokens (64 every 4 steps)" in (out / "report.md").read_text()


def test_a_run_with_long_steps_resumes_to_the_same_weights(workspace, tmp_path):
    """The Trainer fast-forwards an iterable dataset by the steps trained: the resumed run reads what the
    uninterrupted one read (and the long steps stay at their places)."""
    flags = ("--long_block_size", "64", "--long_block_every", "3")
    whole = tmp_path / "whole"
    code, _, stderr = run_main(taper_argv(workspace, whole, *flags))
    assert code == 0, stderr[-3000:]
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    code, output = signal_at_step(taper_argv(workspace, out, *flags), env, step=4, signum=signal.SIGINT)
    assert code == 130, output[-3000:]
    code, _, stderr = run_main([*taper_argv(workspace, out, *flags), "--resume"])
    assert code == 0, stderr[-3000:]
    resumed = load_file(str(out / "tapered" / "model.safetensors"))
    expected = load_file(str(whole / "tapered" / "model.safetensors"))
    for key in expected:
        assert torch.allclose(resumed[key].double(), expected[key].double(), rtol=1e-4, atol=1e-6), key
    # the mix is part of the run: resuming with another one is refused
    message = error_of([*taper_argv(workspace, out, "--long_block_size", "64", "--long_block_every", "2"), "--resume"])
    assert "long_block_every" in message


def test_clear_errors_for_the_long_block_options(workspace, tmp_path):
    out = tmp_path / "out"
    assert error_of([*taper_argv(workspace, out), "--long_block_size", "96"]) == (
        "hf-tapernorm taper: error: --long_block_size 96 exceeds the model's 64 positions"
    )
    assert error_of([*taper_argv(workspace, out), "--long_block_size", "16"]).endswith(
        "--long_block_size 16 must be longer than --block_size 32 (0 turns the long steps off)"
    )
    assert error_of([*taper_argv(workspace, out), "--long_block_size", "-1"]).endswith(
        "--long_block_size must be >= 0, got -1"
    )
    assert error_of([*taper_argv(workspace, out), "--long_block_size", "64", "--long_block_every", "1"]).endswith(
        "--long_block_every must be at least 2, got 1 (every step long: raise --block_size)"
    )
    assert not out.exists()
    assert error_of(["eval", "--model_name_or_path", str(workspace / "llama"), "--long_block_size", "512"]) == (
        "hf-tapernorm eval: error: --long_block_size 512 is a taper option (its long training steps); eval reads "
        "blocks of --block_size and scans longer windows with --scan_windows: leave it out"
    )
