"""A scale joiner for a launch-time slot a scale-down released passes SGLang's own argument
resolution (``sglang/args.check_elastic_ep_args``), with the launch size kept for its layout.

Upstream asserts ``--elastic-ep-initial-size <= --elastic-ep-join-rank-offset`` for every
scale joiner; the joiner for slot 2 of a deployment launched with 3 ranks and shrunk to 2
has offset 2 and initial size 3.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sglang_elastic_ep.sglang.args import add_cli_args, check_elastic_ep_args
from sglang_elastic_ep_testbed.cluster.launcher import ClusterSpec, base_server_args
from sglang_elastic_ep_testbed.cluster.procs import free_port


def joiner_server_args(tiny_model: Path, *, launch_size: int, offset: int) -> object:
    from sglang.srt.server_args import ServerArgs

    spec = ClusterSpec(tiny_model, ep_size=1, max_ep_size=4, moe_a2a_backend="nixl")
    # Resolution only: nothing binds these ports.
    argv = base_server_args(spec, free_port()) + [
        "--dist-init-addr", f"127.0.0.1:{free_port()}",
        "--elastic-ep-join-mode", "scale",
        "--nnodes", "2", "--node-rank", "1", "--moe-dense-tp-size", "1",
        "--elastic-ep-join-rank-offset", str(offset),
        "--elastic-ep-initial-size", str(launch_size),
    ]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_cli_args(None, parser)  # the testbed's launch flags include ours
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_upstream_alone_refuses_a_joiner_below_the_launch_size(tiny_model: Path) -> None:
    server_args = joiner_server_args(tiny_model, launch_size=3, offset=2)
    with pytest.raises(AssertionError, match="cannot exceed the current EP size"):
        server_args.resolve_once()


@pytest.mark.parametrize("launch_size", [3, 2])
def test_a_joiner_resolves_with_the_launch_size_it_was_given(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, launch_size: int) -> None:
    from sglang.srt.arg_groups import parallel_hook
    from sglang.srt.arg_groups.model_override_base import resolved_view

    upstream = parallel_hook.handle_elastic_ep

    def handle_elastic_ep(server_args: object) -> object:  # the hook as SGLang applies it
        return check_elastic_ep_args(upstream, server_args)

    monkeypatch.setattr(parallel_hook, "handle_elastic_ep", handle_elastic_ep)
    server_args = joiner_server_args(tiny_model, launch_size=launch_size, offset=2)
    server_args.resolve_once()
    view = resolved_view(server_args)
    # The launch size fixes the slots per rank of every process: it must come out as given.
    assert view.elastic_ep_initial_size == launch_size
    assert view.ep_join_rank_offset == 2 and view.ep_join_mode == "scale"
