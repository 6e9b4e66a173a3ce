"""The testbed's own plugin: CPU hooks only with the CPU engine, never overlapping the product's."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from sglang_elastic_ep import hooks as product_hooks
from sglang_elastic_ep_testbed import hooks, plugin


def test_registered_under_sglang_plugin_group() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("elastic_ep_testbed") == "sglang_elastic_ep_testbed.plugin:load"


def test_every_cpu_hook_has_a_reason_and_its_own_target() -> None:
    ours = [h.target for h in hooks.HOOKS]
    assert len(ours) == len(set(ours))
    assert not set(ours) & {h.target for h in product_hooks.HOOKS}, (
        "a target hooked by both plugins would depend on plugin load order"
    )
    for hook in hooks.HOOKS:
        assert hook.package == "sglang_elastic_ep_testbed"
        assert len(hook.why) > 20, f"{hook.target}: say why"
    for shim in hooks.IMPORT_SHIMS:
        assert len(shim.why) > 20


def test_nothing_without_the_cpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[object] = []
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(plugin._Registration, "done", False)
    monkeypatch.setattr(product_hooks, "register", registered.append)
    assert plugin.load() is False
    assert registered == []
