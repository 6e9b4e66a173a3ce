"""GPU tests: each skips, printing why, where there is no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT / "sgl-kernel", ROOT / "python"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


def require_cuda() -> None:
    """Skip the calling test, with the reason printed, unless a CUDA device is usable."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a test dependency
        reason = f"needs a CUDA device: torch is not importable ({exc})"
    else:
        if torch.cuda.is_available():
            return
        reason = f"needs a CUDA device: torch {torch.__version__} sees none"
    print(reason)
    pytest.skip(reason)


@pytest.fixture
def cuda() -> None:
    require_cuda()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
