"""Shared fixtures: the tiny model (written once per checkout) and e2e gating."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model

    return write_tiny_model(DEFAULT_DIR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SGLANG_EEP_SKIP_E2E") == "1":
        skip = pytest.mark.skip(reason="SGLANG_EEP_SKIP_E2E=1: CPU-cluster e2e tests skipped")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)
