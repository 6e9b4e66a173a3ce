"""The CPU EP buffer takes the UCX agent a joiner prepared before it joined."""

from __future__ import annotations

import pytest

from sglang_elastic_ep_testbed.nixl_cpu import transport


def test_a_prepared_agent_is_taken_once_by_the_first_transport_of_its_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    def make(name: str, progress_thread: bool) -> object:
        made.append(name)
        return f"agent {name}"

    monkeypatch.setattr(transport, "make_nixl_agent", make)
    monkeypatch.setattr(transport.PreparedAgents, "_ready", {})
    name = transport.PreparedAgents.prepare(2)
    assert name.startswith("nixl-ep-cpu-2-") and made == [name]

    assert transport.NixlTransport(1, 1000, None).agent_name != name  # another rank: its own
    adopted = transport.NixlTransport(2, 1000, None)
    assert (adopted.agent_name, adopted._agent) == (name, f"agent {name}")
    assert len(made) == 2  # only rank 1's agent was made on construction
    again = transport.NixlTransport(2, 1000, None)  # a later buffer makes a fresh one
    assert again.agent_name != name and len(made) == 3
