"""The plugin entry point: registration, version refusal, and the hook table's shape."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

from sglang_elastic_ep import hooks, plugin


def test_registered_under_sglang_plugin_group() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("elastic_ep") == "sglang_elastic_ep.plugin:load"


def test_refuses_other_sglang_version_and_installs_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    registered: list[str] = []
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.22")
    monkeypatch.setattr(plugin, "_loaded", False)
    monkeypatch.setattr(hooks, "active_hooks", lambda: registered.append("hooks") or [])
    with caplog.at_level(logging.ERROR, logger="sglang_elastic_ep"):
        assert plugin.load() is False
    assert registered == []
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "0.5.23" in errors[0].getMessage() and "0.5.22" in errors[0].getMessage()


def test_refuses_when_sglang_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: None)
    monkeypatch.setattr(plugin, "_loaded", False)
    assert plugin.load() is False


def test_every_hook_has_a_reason_and_known_kind() -> None:
    targets = [h.target for h in hooks.HOOKS]
    assert len(targets) == len(set(targets)), "one entry per target keeps the table readable"
    for hook in hooks.HOOKS:
        assert hook.kind in {"BEFORE", "AFTER", "AROUND", "REPLACE"}
        assert hook.scope in {"all", "cpu"}
        assert len(hook.why) > 20, f"{hook.target}: say why"
    for shim in hooks.IMPORT_SHIMS:
        assert len(shim.why) > 20


def test_cpu_hooks_only_with_cpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    off = hooks.active_hooks()
    assert all(h.scope == "all" for h in off)
    assert hooks.active_import_shims() == []
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    on = hooks.active_hooks()
    assert {h.scope for h in on} == {"all", "cpu"}
    assert len(on) > len(off)
