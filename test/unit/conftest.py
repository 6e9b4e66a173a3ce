"""Unit tests never import SGLang's managers (they pull in torchvision and take seconds)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest


class _FakeIoStruct(ModuleType):
    """``sglang.srt.managers.io_struct`` for adapters under unit test: each request struct is a
    plain record of its keyword arguments (one class per name, so isinstance checks hold)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        struct = type(name, (SimpleNamespace,), {})
        setattr(self, name, struct)
        return struct


@pytest.fixture
def fake_io_struct(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, ModuleType(name))
    module = _FakeIoStruct("sglang.srt.managers.io_struct")
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)
    yield module
