"""The robustness scan: windows at any offset and length, broken windows judged on their worst stretch."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_tapernorm.app.report import render_markdown
from hf_tapernorm.data.heldout import EvaluationSet, sample_blocks
from hf_tapernorm.evaluation.scan import (
    MIN_WINDOWS,
    ScanResult,
    _worst_stretch,
    draw_offsets,
    gap_interval,
    robustness_scan,
    scan_lengths,
    scan_line,
    scan_summary,
    sink_share_fall,
    sink_shares,
    window_counts,
)
from tests.conftest import build, char_tokenizer, corpus_documents, tiny_llama_config

SINK = 127  # the char tokenizer's EOS, used as the sink


@pytest.fixture(scope="module")
def text():
    tokenizer = char_tokenizer()
    documents = [(f"doc {i}", d) for i, d in enumerate(corpus_documents(40))]
    return sample_blocks(documents, tokenizer, block_size=16, count=8, prefix_ids=[SINK], name="held-out")


@pytest.fixture(scope="module")
def model():
    return build(tiny_llama_config(max_position_embeddings=64))


class Saboteur(nn.Module):
    """The wrapped model, except that every prediction after ``trigger`` puts all its mass on token 0: a model that
    breaks past one token, as a runaway tapered model does."""

    def __init__(self, inner: nn.Module, trigger: int, margin: float = 60.0) -> None:
        super().__init__()
        self.inner, self.trigger, self.margin, self.config = inner, trigger, margin, inner.config

    def forward(self, input_ids, **kwargs):
        logits = self.inner(input_ids=input_ids, **kwargs).logits.clone()
        seen = input_ids.eq(self.trigger).cumsum(dim=1) > 0
        garbage = torch.full_like(logits[0, 0], -self.margin)
        garbage[0] = 0.0
        logits[seen] = garbage
        return SimpleNamespace(logits=logits)


def test_lengths_counts_and_offsets():
    assert scan_lengths(128, 8192) == [128, 256, 512, 1024]
    assert scan_lengths(128, 300) == [128, 256]  # up to the model's positions
    assert scan_lengths(128, None) == [128, 256, 512, 1024]
    assert window_counts(32, [128, 256, 512, 1024]) == {128: 32, 256: 16, 512: 8, 1024: 4}  # equal tokens per length
    assert window_counts(4, [16, 128]) == {16: 4, 128: MIN_WINDOWS}
    offsets = draw_offsets(1000, 100, 50, seed=3)
    assert len(offsets) == 50 and len(set(offsets.tolist())) == 50 and int(offsets.max()) <= 900
    assert torch.equal(offsets, draw_offsets(1000, 100, 50, seed=3))  # the same windows for every run
    assert not torch.equal(offsets, draw_offsets(1000, 100, 50, seed=4))
    assert draw_offsets(10, 20, 5, seed=0).numel() == 0  # a stream shorter than one window
    assert draw_offsets(12, 10, 5, seed=0).tolist() == [0, 1, 2]  # fewer places than windows: each once


def test_worst_stretch_is_the_largest_mean_of_consecutive_tokens():
    generator = torch.Generator().manual_seed(0)
    excess = torch.randn(5, 40, generator=generator)
    stretch = 7
    brute = torch.stack([excess[:, i : i + stretch].mean(1) for i in range(40 - stretch + 1)], dim=1).max(1).values
    assert torch.allclose(_worst_stretch(excess, stretch), brute.double(), atol=1e-9)
    assert torch.allclose(_worst_stretch(excess, 100), excess.double().mean(1))  # a stretch longer than the window


def test_the_gap_interval_resamples_windows_and_widens_when_one_window_carries_the_gap():
    generator = torch.Generator().manual_seed(5)
    reference = 2 + torch.rand(8, 30, generator=generator)
    even = reference * 1.05  # every window 5% worse: no doubt about the gap
    low, high = gap_interval(even, reference)
    assert low == pytest.approx(0.05, abs=1e-6) and high == pytest.approx(0.05, abs=1e-6)
    one = reference.clone()
    one[3] *= 1.4  # one window carries the whole gap
    gap = float(one.sum() / reference.sum() - 1)
    low, high = gap_interval(one, reference)
    assert low < 0.01 < gap < high  # resamples without that window see no gap at all
    assert gap_interval(one, reference) == (low, high)  # seeded: a report's interval can be read again
    assert gap_interval(one[:1], reference[:1]) is None  # one window: no interval


def test_a_model_scanned_against_itself_has_no_broken_window(text, model):
    result = robustness_scan(model, model, [text], block_size=16, windows=8, max_positions=64)
    assert [(row.length, row.windows) for row in result.rows] == [(16, 8), (32, 4), (64, 2)]  # 128 > 64 positions
    for row in result.rows:
        assert row.broken == 0 and abs(row.gap) < 1e-6 and row.gap_without_broken == pytest.approx(row.gap)
        assert row.tokens == row.windows * (row.length - 2)  # sink and first text token are no targets
        assert row.gap_interval == pytest.approx((0.0, 0.0), abs=1e-6)
    assert result.broken == 0 and result.windows == 14
    assert len(result.worst) == 10 and all(abs(w.worst_excess) < 1e-5 for w in result.worst)
    assert all(w.sink_share == {} for w in result.worst)  # only broken windows get the attention diagnostic
    again = ScanResult.from_dict(result.to_dict())
    assert again.to_dict() == result.to_dict()


def test_a_model_that_breaks_after_a_token_is_caught_at_every_offset(text, model):
    trigger = int(text.stream[len(text.stream) // 2])  # a character of the text: some windows hold it
    tokenizer = char_tokenizer()
    result = robustness_scan(
        Saboteur(model, trigger), model, [text], block_size=16, windows=8, max_positions=64, tokenizer=tokenizer
    )
    for row in result.rows:
        assert row.broken > 0 and row.gap > 0.5
        assert row.gap_interval[0] <= row.gap <= row.gap_interval[1]
        assert row.gap_without_broken is None or row.gap_without_broken < row.gap
    worst = result.worst[0]
    assert worst.worst_excess > 2.0 and worst.document.startswith("doc ")
    window = text.stream[worst.offset : worst.offset + worst.length - 1]
    assert trigger in window.tolist()  # the broken window holds the trigger
    assert worst.first_tokens == tokenizer.decode(window[:16].tolist())
    line = scan_line(result.to_dict(), where="report.md")
    assert line.startswith("WARNING: the folded model breaks on") and "report.md" in line
    assert f"{result.broken} broken of {result.windows} windows" in scan_summary(result.to_dict())


def test_a_long_window_is_judged_by_its_worst_stretch_not_its_mean(model):
    """A 64-token window that breaks only over its last 12 tokens (about 3 nats each) is broken: its mean excess is
    well under 2 nats, its worst 14-target stretch (a 16-token training block) well over."""
    stream = torch.randint(1, 120, (63,), generator=torch.Generator().manual_seed(2))
    trigger = 121  # not in the stream but at one place
    stream[50] = trigger
    blocks = torch.cat([torch.tensor([SINK]), stream[:15]])[None]
    only = EvaluationSet("one", "", blocks, torch.zeros(1, 14, dtype=torch.long), ["doc"], 1, stream, torch.zeros(63))
    result = robustness_scan(
        Saboteur(model, trigger, margin=8.0), model, [only], block_size=16, windows=1, max_positions=64
    )
    long_row = [row for row in result.rows if row.length == 64][0]
    assert long_row.windows == 1 and long_row.broken == 1
    assert long_row.model_loss - long_row.reference_loss < 1.0  # the mean alone would not call it broken
    assert result.worst[0].length == 64 and result.worst[0].worst_excess > 2.0


def test_sink_shares_read_every_layer_and_restore_the_attention_implementation(model):
    ids = torch.cat(
        [torch.tensor([[SINK]]), torch.randint(0, 120, (1, 30), generator=torch.Generator().manual_seed(1))], 1
    )
    before = model.config._attn_implementation
    shares = sink_shares(model, ids)
    assert len(shares) == model.config.num_hidden_layers and all(0.0 <= s <= 1.0 for s in shares)
    assert model.config._attn_implementation == before
    same = sink_share_fall(model, model, ids)
    assert same["model"] == same["reference"] and same["falls_at_layer"] is None


def test_the_scan_refuses_a_set_without_its_stream(text, model):
    bare = copy.copy(text)
    bare.stream = None
    with pytest.raises(ValueError, match="no token stream"):
        robustness_scan(model, model, [bare], block_size=16, windows=2, max_positions=64)


def test_the_report_says_which_worst_windows_were_traced_and_where_the_sink_share_fell(text, model):
    tokenizer = char_tokenizer()
    trigger = int(text.stream[len(text.stream) // 2])
    result = robustness_scan(
        Saboteur(model, trigger), model, [text], block_size=16, windows=8, max_positions=64, tokenizer=tokenizer
    ).to_dict()
    broken, intact = copy.deepcopy(result["worst"][0]), copy.deepcopy(result["worst"][0])
    intact["sink_share"] = {}  # as the scan leaves a window under the threshold
    broken["sink_share"] = {"model": [0.5, 0.1], "reference": [0.5, 0.6], "falls_at_layer": 1}
    held = dict(broken, sink_share={"model": [0.5], "reference": [0.5], "falls_at_layer": None})
    result["worst"] = [broken, held, intact]
    section = render_markdown({"status": "finished", "robustness_scan": result}, {})
    rows = [line for line in section.splitlines() if line.startswith(f"| {text.name} | ") and "`" in line]
    assert [row.split(" | ")[5] for row in rows] == ["1", "none", "not traced"]
    length_rows = [line for line in section.splitlines() if line.startswith(f"| {text.name} | 16 | 8 |")]
    low, high = result["rows"][0]["gap_interval"]
    assert length_rows and f" | {100 * low:+.2f}% to {100 * high:+.2f}% | " in length_rows[0]
