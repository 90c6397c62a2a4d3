"""Evaluation diagnostics: the broken blocks a mean hides."""

import pytest
import torch

from hf_tapernorm.evaluation.scores import Scores, broken_blocks


def test_broken_blocks_are_counted_and_left_out_of_the_second_gap():
    reference = Scores(torch.full((4, 3), 2.0))
    model = Scores(torch.tensor([[2.2] * 3, [2.1] * 3, [9.0] * 3, [2.0] * 3]))
    result = broken_blocks(model, reference)
    assert result["blocks"] == [2]
    assert result["gap_without"] == pytest.approx((2.2 + 2.1 + 2.0) / 3 / 2.0 - 1)
    assert broken_blocks(model, reference, threshold=10.0)["blocks"] == []
