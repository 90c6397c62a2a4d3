"""Position spans (``--position_span``): how a block's positions spread, what the model and the teacher read, the
run's record, and the option's errors."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import TrainerCallback

from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.app.position_span import spread_positions, with_spread_positions
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.training.distillation import Distillation, distillation_loss
from tests.conftest import build, random_batches, tiny_llama_config
from tests.helpers import error_of, run_main, spy_on_trainings, taper_argv


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


def test_the_teacher_reads_the_student_s_positions():
    batch = random_batches(n=1, batch=2, length=24)[0]
    positions = torch.tensor([spread_positions(24, 0, 300, torch.Generator().manual_seed(s)) for s in (1, 2)])
    teacher = _sharp(build(tiny_llama_config(max_position_embeddings=512))).eval()
    student = patch_model(build(tiny_llama_config(max_position_embeddings=512)), TaperNormConfig.paper())
    distillation = Distillation(teacher, weight=1.0).attach(student)
    with torch.no_grad():
        at_positions = teacher(input_ids=batch, position_ids=positions).logits
        contiguous = teacher(input_ids=batch).logits
        # a student that equals the teacher at these positions: no KL there, some against the contiguous teacher
        assert float(distillation(at_positions, batch, position_ids=positions)) == pytest.approx(0.0, abs=1e-9)
        against_contiguous = float(distillation_loss(at_positions[:, :-1], contiguous[:, :-1]))
        assert against_contiguous > 1e-6
        assert float(distillation(at_positions, batch)) == pytest.approx(against_contiguous, rel=1e-4)
    distillation.remove()


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
    code, stdout, stderr = run_main(taper_argv(workspace, out, "--position_span", "64", "--baseline"))
    assert code == 0, stderr[-3000:]
    tapered, baseline = seen
    assert len(tapered.positions) == 10 and all(p is not None and p.shape == (2, 32) for p in tapered.positions)
    assert all(m is not None and bool((m == 1).all()) for m in tapered.masks)
    spread = torch.cat(tapered.positions)
    assert int(spread.max()) <= 63 and int(spread.max()) > 31 and bool((spread[:, 0] == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(tapered.positions, baseline.positions))  # the same blocks
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["position_span"] == 64 and report["training"]["tokens"] == 10 * 2 * 32
    assert "blocks of 32 tokens (positions spread over 64)" in stdout
    code, _, stderr = run_main([*taper_argv(workspace, out), "--resume"])
    assert code != 0 and "position_span" in stderr  # a resume without it is another run


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--position_span", "32"], "--position_span 32 must be longer than --block_size 32 (0 keeps the positions"),
        (["--position_span", "-4"], "--position_span must be >= 0, got -4"),
        (["--position_span", "100000"], "--position_span 100000"),
    ],
)
def test_spans_that_are_none_or_beyond_the_model_are_refused(workspace, tmp_path, flags, message):
    assert message in error_of(taper_argv(workspace, tmp_path / "run", *flags))
    assert not (tmp_path / "run").exists()


def test_eval_refuses_the_taper_option(workspace):
    message = error_of(["eval", "--model_name_or_path", str(workspace / "llama"), "--position_span", "256"])
    assert "--position_span 256 is a taper option (the positions of its training blocks)" in message
