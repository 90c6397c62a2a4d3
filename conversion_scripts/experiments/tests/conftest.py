"""The experiments' own tests: marked ``experiments`` and run apart from the product suite (``make
test-experiments``; ``make test`` runs them after it). They reuse the product suite's tiny-model fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_gpt2, tiny_llama, tiny_model, workspace  # noqa: F401 - fixtures

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.experiments)
