"""The control plane's topology comes from SGLang 0.5.23's server args (attn_dp_size)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_elastic_ep.sglang.http_adapter import topology_from_args


def test_one_rank_per_attention_replica_with_dp_attention() -> None:
    # what 0.5.23 resolves `--tp 2 --dp 2 --enable-dp-attention --max-ep-size 4` to
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=2, max_ep_size=4)
    topology, ep_size = topology_from_args(args)
    assert ep_size == 2 and topology.max_ep_size == 4 and topology.attn_replica_size == 1


def test_without_attention_dp_the_whole_tp_group_is_one_replica() -> None:
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=1, max_ep_size=None)
    topology, ep_size = topology_from_args(args)
    assert ep_size == 2 and topology.max_ep_size == 2 and topology.attn_replica_size == 2


def test_the_tokenizer_managers_replica_size_wins_over_server_args() -> None:
    # the HTTP process's args read as one 2-rank replica; the tokenizer manager knows better
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=None, max_ep_size=4)
    assert topology_from_args(args)[0].attn_replica_size == 2
    topology, ep_size = topology_from_args(args, replica_size=1)
    assert ep_size == 2 and topology.attn_replica_size == 1
