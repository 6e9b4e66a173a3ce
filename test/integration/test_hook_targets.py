"""Every hook in the table names something that exists in the installed SGLang 0.5.23."""

from __future__ import annotations

import pkgutil

import pytest

pytest.importorskip("sglang")

from sglang_elastic_ep import hooks  # noqa: E402
from sglang_elastic_ep_testbed import hooks as testbed_hooks  # noqa: E402


@pytest.mark.parametrize("hook", hooks.HOOKS + testbed_hooks.HOOKS,
                         ids=lambda h: h.target.removeprefix("sglang.srt."))
def test_hook_target_and_impl_resolve(hook: hooks.Hook) -> None:
    owner_path, _, attr = hook.target.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    assert hasattr(owner, attr), f"{hook.target} does not exist in this SGLang"
    assert callable(hook.resolve())


def test_ep_join_mode_alias_parses_and_conflicts_fail() -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_elastic_ep.sglang import args as eep_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    eep_args.add_cli_args(None, parser)
    ns = parser.parse_args(["--model-path", "m", "--ep-join-mode", "recover"])
    assert ns.eep_join_mode_alias == "recover"
    assert eep_args.resolve_join_mode(None, "recover") == "recover"
    assert eep_args.resolve_join_mode("scale", None) == "scale"
    assert eep_args.resolve_join_mode("scale", "scale") == "scale"
    with pytest.raises(ValueError, match="contradicts"):
        eep_args.resolve_join_mode("scale", "recover")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--ep-join-mode", "grow"])
    # A replacement for scale-joined slots keeps their join offset and joins as a scale joiner.
    slot = parser.parse_args(["--model-path", "m", "--ep-join-mode", "recover",
                              "--elastic-ep-join-rank-offset", "2"])
    assert slot.ep_join_rank_offset == 2
    assert eep_args.join_mode_for_slot("recover", slot.ep_join_rank_offset) == "scale"
    assert eep_args.join_mode_for_slot("recover", 0) == "recover"
    assert eep_args.join_mode_for_slot("scale", 2) == "scale"
    assert eep_args.join_mode_for_slot(None, 0) is None


def test_eplb_flags_elastic_default_and_min_ranks_validation() -> None:
    import argparse
    from types import SimpleNamespace

    from sglang.srt.server_args import ServerArgs

    from sglang_elastic_ep.sglang import args as eep_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    eep_args.add_cli_args(None, parser)
    ns = parser.parse_args(["--model-path", "m", "--elastic-ep-expert-min-ranks", "2"])
    assert ns.elastic_ep_expert_min_ranks == 2
    assert parser.parse_args(["--model-path", "m"]).elastic_ep_expert_min_ranks == 1

    def eplb(backend: str | None, enabled: bool, algorithm: str) -> str:
        server_args = SimpleNamespace(elastic_ep_backend=backend, enable_eplb=enabled,
                                      eplb_algorithm=algorithm)
        eep_args.prefer_elasticity_aware_eplb(server_args)
        return server_args.eplb_algorithm

    assert eplb("mooncake", True, "auto") == "elasticity_aware"
    assert eplb("mooncake", True, "deepseek") == "deepseek"  # the operator's choice stays
    assert eplb(None, True, "auto") == "auto"  # not elastic: upstream's auto
    assert eplb("mooncake", False, "auto") == "auto"


def test_a_deployment_launched_at_its_max_reserves_one_replica_to_grow_into() -> None:
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import args as eep_args

    def capacity(**kw: object) -> tuple[int | None, int | None]:
        server_args = SimpleNamespace(elastic_ep_backend="mooncake", ep_join_mode=None,
                                      elastic_ep_initial_size=None, **kw)
        eep_args.reserve_room_to_grow(server_args)
        return server_args.max_ep_size, eep_args.declared_max_ep_size(server_args)

    # Launched at its max: one attention replica more inside, the declared max outside.
    assert capacity(max_ep_size=3, tp_size=3, dp_size=3) == (4, 3)
    assert capacity(max_ep_size=4, tp_size=4, dp_size=2) == (6, 4)  # replicas of 2 ranks
    assert capacity(max_ep_size=3, tp_size=3, dp_size=1, attn_dp_size=3) == (4, 3)
    # Its scale joiner (launch size from --elastic-ep-initial-size) computes the same.
    joiner = SimpleNamespace(elastic_ep_backend="mooncake", ep_join_mode="scale",
                             elastic_ep_initial_size=3, max_ep_size=3, tp_size=1, dp_size=1)
    eep_args.reserve_room_to_grow(joiner)
    assert (joiner.max_ep_size, eep_args.declared_max_ep_size(joiner)) == (4, 3)
    # Room to grow already, or not elastic: unchanged.
    assert capacity(max_ep_size=4, tp_size=2, dp_size=2) == (4, 4)
    plain = SimpleNamespace(elastic_ep_backend=None, max_ep_size=None, tp_size=2)
    eep_args.reserve_room_to_grow(plain)
    assert plain.max_ep_size is None


# ------------------------------------------------- NIXL data-plane hooks: gated pass-through


class _Cls:
    """Stands in for the class a classmethod hook receives."""


_AROUND = [
    ("hook_nixl_on_scale", "nixl_on_scale", (_Cls, 2, 3), {}),
    ("hook_nixl_get_nixl_buffer", "nixl_get_nixl_buffer", (_Cls, "group", 64, "mode"),
     {"num_experts": 16}),
    ("hook_is_active_equal_last", "state_is_active_equal_last", ("state",), {}),
    ("hook_maybe_recover_ep_ranks", "maybe_recover_ep_ranks", (),
     {"tp_group": "g", "eplb_manager": "m", "model_config": "c", "moe_ep_rank": 0}),
]
_AFTER = [
    ("hook_after_snapshot_active_to_last", "state_after_snapshot_active_to_last"),
    ("hook_after_sync_active_to_cpu", "state_after_sync_active_to_cpu"),
]


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize(("hook", "impl", "args", "kwargs"), _AROUND, ids=[a[0] for a in _AROUND])
def test_nixl_around_hooks_are_upstream_without_elastic_ep(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, hook: str, impl: str, args: tuple,
    kwargs: dict,
) -> None:
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as nbh

    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(nbh, "elastic_ep_enabled", lambda: enabled)
    monkeypatch.setattr(nbh, impl, lambda *a, **k: calls.append(("ours", a, k)) or "ours")

    def original(*a: object, **k: object) -> str:
        calls.append(("upstream", a, k))
        return "upstream"

    got = getattr(nbh, hook)(original, *args, **kwargs)
    who = "ours" if enabled else "upstream"
    assert got == who and calls == [(who, args, kwargs)]


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize(("hook", "impl"), _AFTER, ids=[a[0] for a in _AFTER])
def test_nixl_after_hooks_do_nothing_without_elastic_ep(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, hook: str, impl: str
) -> None:
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import expert_dispatch
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as nbh

    calls: list[str] = []
    monkeypatch.setattr(nbh, "elastic_ep_enabled", lambda: enabled)
    monkeypatch.setattr(nbh, impl, lambda *a, **k: calls.append(impl))
    monkeypatch.setattr(expert_dispatch, "log_replica_coverage", lambda m: calls.append("log"))
    assert getattr(nbh, hook)(None, SimpleNamespace(active_ranks_cpu=None)) is None
    if not enabled:
        assert calls == []
    else:
        assert calls[0] == impl


def test_classmethod_around_hook_through_sglangs_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """HookRegistry unwraps a classmethod and hands our AROUND hook (original, cls, ...)."""
    import sys
    import types

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_elastic_ep.sglang import nixl_buffer_hooks as nbh

    class Buffer:
        seen: list = []

        @classmethod
        def on_scale(cls, from_ep_size: int, to_ep_size: int) -> None:
            cls.seen.append(("upstream", cls, from_ep_size, to_ep_size))

    mod = types.ModuleType("eep_fake_nixl")
    mod.Buffer = Buffer
    monkeypatch.setitem(sys.modules, "eep_fake_nixl", mod)
    HookRegistry._apply_target(
        "eep_fake_nixl.Buffer.on_scale", [(HookType.AROUND, nbh.hook_nixl_on_scale, None)]
    )
    monkeypatch.setattr(nbh, "elastic_ep_enabled", lambda: False)
    Buffer.on_scale(2, 3)
    assert Buffer.seen == [("upstream", Buffer, 2, 3)]
    monkeypatch.setattr(nbh, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(nbh, "nixl_on_scale", lambda cls, a, b: Buffer.seen.append(("ours", cls)))
    Buffer.on_scale(3, 4)
    assert Buffer.seen[-1] == ("ours", Buffer)


def test_nixl_rows_live_only_in_the_hook_table() -> None:
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as nbh

    assert "HOOKS" not in vars(nbh), "hooks.HOOKS is the one list; nixl_buffer_hooks derives"
    rows = [h for h in hooks.HOOKS if h.impl.startswith("sglang.nixl_buffer_hooks:")]
    assert len(rows) == 6
    assert nbh.HOOKS == [(h.target, h.resolve(), h.kind, h.why) for h in rows]
