"""The plugin entry points: registration, version refusal, and the hook tables' shape."""

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
    registered: list[object] = []
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.22")
    monkeypatch.setattr(plugin._Registration, "done", False)
    monkeypatch.setattr(hooks, "register", registered.append)
    with caplog.at_level(logging.ERROR, logger="sglang_elastic_ep"):
        assert plugin.load() is False
    assert registered == []
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "0.5.23" in errors[0].getMessage() and "0.5.22" in errors[0].getMessage()


def test_refuses_when_sglang_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: None)
    monkeypatch.setattr(plugin._Registration, "done", False)
    assert plugin.load() is False


def test_registers_the_whole_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[object] = []
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(plugin._Registration, "done", False)
    monkeypatch.setattr(hooks, "register", registered.append)
    assert plugin.load() is True and plugin.load() is True
    assert registered == [hooks.HOOKS]


def test_every_hook_has_a_reason_and_known_kind() -> None:
    targets = [h.target for h in hooks.HOOKS]
    assert len(targets) == len(set(targets)), "one entry per target keeps the table readable"
    for hook in hooks.HOOKS:
        assert hook.kind in {"BEFORE", "AFTER", "AROUND", "REPLACE"}
        assert hook.package == "sglang_elastic_ep"
        assert len(hook.why) > 20, f"{hook.target}: say why"
