"""Every hook in the table names something that exists in the installed SGLang 0.5.23."""

from __future__ import annotations

import pkgutil

import pytest

pytest.importorskip("sglang")

from sglang_elastic_ep import hooks  # noqa: E402


@pytest.mark.parametrize("hook", hooks.HOOKS, ids=lambda h: h.target.removeprefix("sglang.srt."))
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
