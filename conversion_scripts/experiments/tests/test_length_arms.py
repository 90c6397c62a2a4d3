"""The length arms (length_arms.py): long training steps and spread positions, what the Trainer receives, the run's
record and identity, a resumed run, a run under torchrun, and the options' errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal

import datasets
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import TrainerCallback, default_data_collator

from conversion_scripts.experiments.length_arms import (
    LengthMix,
    MixedLengthBlocks,
    main,
    spread_positions,
    with_spread_positions,
)
from hf_tapernorm import ConfigurationError
from tests.conftest import build, random_batches, tiny_llama_config
from tests.helpers import REPO, error_of, signal_at_step, spy_on_trainings, taper_argv, torchrun_taper

SCRIPT = "conversion_scripts.experiments.length_arms"


def arms_argv(ws, out, *extra: str) -> list[str]:
    """The script's command line: the ``taper`` options of tests/helpers.taper_argv, without the command."""
    return taper_argv(ws, out, *extra)[1:]


def run_arms(argv: list[str]) -> tuple[int, str, str]:
    """The script in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def arms_error(argv: list[str]) -> str:
    """The one-line error of a refused run (exit status 2)."""
    code, _, stderr = run_arms(argv)
    assert code == 2, stderr[-2000:]
    return [line for line in stderr.strip().splitlines() if line.startswith("hf-tapernorm")][-1]


def _blocks(count: int, length: int, start: int = 0) -> datasets.Dataset:
    """``count`` blocks of ``length`` tokens; block i holds the token ``start + i`` throughout (to tell them apart)."""
    ids = [[start + i] * length for i in range(count)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")


# ----------------------------------------------------------------------------- long steps
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
    argv = arms_argv(workspace, out, "--long_block_size", "64", "--long_block_every", "4", "--baseline")
    code, stdout, stderr = run_arms(argv)
    assert code == 0, stderr[-3000:]
    tapered, baseline = seen
    assert tapered.step_lengths == [32, 32, 32, 64, 32, 32, 32, 64, 32, 32]
    assert baseline.step_lengths == tapered.step_lengths  # the baseline reads the same mix
    report = json.loads((out / "report.json").read_text())
    data = report["data"]
    assert (data["long_block_size"], data["long_block_every"], data["long_train_blocks"]) == (64, 4, 4)
    assert data["train_blocks"] == 16  # 8 short steps of 2
    assert report["training"]["tokens"] == 2 * (8 * 32 + 2 * 64)
    line = "blocks of 32 tokens (long_block_size 64, long_block_every 4, long_train_blocks 4)"
    assert line in stdout and line in (out / "report.md").read_text()
    identity = json.loads((out / ".hf_tapernorm_run.json").read_text())["identity"]["data"]
    assert (identity["long_block_size"], identity["long_block_every"]) == (64, 4)


def test_a_run_with_long_steps_resumes_to_the_same_weights(workspace, tmp_path):
    """The Trainer fast-forwards an iterable dataset by the steps trained: the resumed run reads what the
    uninterrupted one read (and the long steps stay at their places)."""
    flags = ("--long_block_size", "64", "--long_block_every", "3")
    whole = tmp_path / "whole"
    code, _, stderr = run_arms(arms_argv(workspace, whole, *flags))
    assert code == 0, stderr[-3000:]
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    arms = "conversion_scripts.experiments.length_arms"
    code, output = signal_at_step(arms_argv(workspace, out, *flags), env, step=4, signum=signal.SIGINT, entry=arms)
    assert code == 130, output[-3000:]
    code, _, stderr = run_arms([*arms_argv(workspace, out, *flags), "--resume"])
    assert code == 0, stderr[-3000:]
    resumed = load_file(str(out / "tapered" / "model.safetensors"))
    expected = load_file(str(whole / "tapered" / "model.safetensors"))
    for key in expected:
        assert torch.allclose(resumed[key].double(), expected[key].double(), rtol=1e-4, atol=1e-6), key
    # the mix is part of the run: resuming with another one, or without the script, is refused
    message = arms_error([*arms_argv(workspace, out, "--long_block_size", "64", "--long_block_every", "2"), "--resume"])
    assert "data.long_block_every: 3 in the run, 2 now" in message
    message = error_of([*taper_argv(workspace, out), "--resume"])
    assert "data.long_block_size: 64 in the run, None now" in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--long_block_size", "96"), "taper: error: --long_block_size 96 exceeds the model's 64 positions"),
        (("--long_block_size", "16"), "--long_block_size 16 must be longer than --block_size 32 (0 turns the long"),
        (("--long_block_size", "-1"), "--long_block_size must be >= 0, got -1"),
        (("--long_block_size", "64", "--long_block_every", "1"), "--long_block_every must be at least 2, got 1"),
        (
            ("--long_block_size", "64", "--long_block_every", "100"),
            "the first long step is step 100, and this run has 10 (--max_steps), so no step would read long blocks; "
            "a long step needs --max_steps 100 or more",
        ),
        (("--position_span", "32"), "--position_span 32 must be longer than --block_size 32 (0 keeps the positions"),
        (("--position_span", "-4"), "--position_span must be >= 0, got -4"),
        (("--position_span", "100000"), "--position_span 100000 exceeds the model's 64 positions"),
    ],
)
def test_options_that_are_none_or_beyond_the_model_are_refused_in_one_line(workspace, tmp_path, flags, message):
    out = tmp_path / "run"
    assert message in arms_error(arms_argv(workspace, out, *flags))
    assert not out.exists()


def test_long_steps_under_torchrun_with_two_cpu_processes(tmp_path):
    """accelerate dispatches an iterable dataset's batches from the main process: every step keeps one length."""
    _, out = torchrun_taper(tmp_path, ["-m", SCRIPT], "--long_block_size", "64", "--long_block_every", "3")
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and report["training"]["world_size"] == 2
    assert report["training"]["steps"] == 8 and report["training"]["tokens"] == 4 * (6 * 32 + 2 * 64)


# ----------------------------------------------------------------------------- spread positions
def _sharp(model):
    """A random tiny model attends almost uniformly, so positions barely show: sharpen its attention."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def test_positions_keep_the_sink_rise_strictly_jump_at_most_twice_and_reach_the_span():
    generator = torch.Generator().manual_seed(0)
    highest = []
    for _ in range(300):
        positions = spread_positions(32, 1, 256, generator)
        assert len(positions) == 32 and positions[0] == 0
        steps = [b - a for a, b in zip(positions, positions[1:])]
        assert all(step >= 1 for step in steps)  # in order: the text keeps its tokens' order
        assert sum(step > 1 for step in steps) <= 2  # one skip after the sink, one at the cut
        assert positions[-1] <= 255
        highest.append(positions[-1])
    assert max(highest) >= 240 and min(highest) <= 60  # skips from none to the whole span
    assert spread_positions(8, 2, 8, generator) == list(range(8))  # a span of the block's length: no room to skip
    with pytest.raises(ConfigurationError, match="--position_span 16 must be at least the block's 32 tokens"):
        spread_positions(32, 1, 16, generator)


def test_each_block_s_positions_depend_on_the_seed_and_its_index_alone():
    ids = [[i] * 16 for i in range(6)]
    blocks = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")
    spread = with_spread_positions(blocks, 128, 1, seed=3)
    assert spread.column_names == ["input_ids", "labels", "position_ids", "attention_mask"]
    assert torch.equal(spread[:]["input_ids"], blocks[:]["input_ids"])  # the tokens are untouched
    assert bool((spread[:]["attention_mask"] == 1).all())
    again, other = with_spread_positions(blocks, 128, 1, seed=3), with_spread_positions(blocks, 128, 1, seed=4)
    assert torch.equal(spread[:]["position_ids"], again[:]["position_ids"])
    assert not torch.equal(spread[:]["position_ids"], other[:]["position_ids"])
    fewer = with_spread_positions(blocks.select(range(5)), 128, 1, seed=3)  # block 4 has the same index there
    assert torch.equal(fewer[4]["position_ids"], spread[4]["position_ids"])


def test_with_the_mask_attention_stays_causal_across_the_skips():
    """transformers reads jumping position ids without a mask as sequences packed into one row; the spread blocks
    carry a mask, so the last position still sees the first token of the text."""
    model = _sharp(build(tiny_llama_config(max_position_embeddings=512))).eval()
    ids = random_batches(n=1, batch=1, length=24)[0]
    positions = torch.tensor([[0, *range(51, 62), *range(262, 274)]])  # skips after the sink and at a cut
    mask = torch.ones_like(ids)
    changed = ids.clone()
    changed[0, 1] = (changed[0, 1] + 1) % 128
    with torch.no_grad():
        last = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0, -1]
        last_changed = model(input_ids=changed, position_ids=positions, attention_mask=mask).logits[0, -1]
        contiguous = model(input_ids=ids, attention_mask=mask).logits[0, -1]
    assert not torch.allclose(last, last_changed)  # the first text token reaches the last position
    assert not torch.allclose(last, contiguous)  # and the positions are read


class _Positions(TrainerCallback):
    """The position ids and masks of every training forward, read from the model's forward."""

    def __init__(self) -> None:
        self.positions: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, args, kwargs):
            if module.training:
                self.positions.append(kwargs.get("position_ids"))
                self.masks.append(kwargs.get("attention_mask"))

        model.register_forward_pre_hook(record, with_kwargs=True)


def test_a_taper_run_trains_on_spread_positions_and_records_them(workspace, tmp_path, monkeypatch):
    seen = spy_on_trainings(monkeypatch, _Positions)
    out = tmp_path / "run"
    code, stdout, stderr = run_arms(arms_argv(workspace, out, "--position_span", "64", "--baseline"))
    assert code == 0, stderr[-3000:]
    tapered, baseline = seen
    assert len(tapered.positions) == 10 and all(p is not None and p.shape == (2, 32) for p in tapered.positions)
    assert all(m is not None and bool((m == 1).all()) for m in tapered.masks)
    spread = torch.cat(tapered.positions)
    assert int(spread.max()) <= 63 and int(spread.max()) > 31 and bool((spread[:, 0] == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(tapered.positions, baseline.positions))  # the same blocks
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["position_span"] == 64 and report["training"]["tokens"] == 10 * 2 * 32
    assert "blocks of 32 tokens (position_span 64)" in stdout
    message = error_of([*taper_argv(workspace, out), "--resume"])  # a resume without it is another run
    assert "data.position_span: 64 in the run, None now" in message
