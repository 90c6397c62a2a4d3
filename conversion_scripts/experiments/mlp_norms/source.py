"""What a testbed run trains and scores: the model, its sink, its training batches and held-out blocks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class Source:
    model: nn.Module
    sink_ids: list
    batches: Iterator[torch.Tensor]
    held: torch.Tensor
    pretrain_tokens: Optional[int]
    params: int
