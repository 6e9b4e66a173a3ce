"""The load signal read from SGLang's Prometheus text."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.controller.load import parse_load

TEXT = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="1"} 2.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 10.0
sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="1"} 6.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="m",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",model_name="m",tp_rank="1"} 0.7
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",model_name="m",tp_rank="0"} 99.0
"""


def test_means_per_shard() -> None:
    reading = parse_load([TEXT])
    assert reading is not None
    assert (reading.queued_per_rank, reading.running_per_rank, reading.shards) == (3.0, 8.0, 2)
    assert reading.kv_usage == pytest.approx(0.6)


def test_tp_ranks_of_one_shard_count_once() -> None:
    text = """\
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 5
sglang:num_queue_reqs{model_name="m",tp_rank="1"} 5
sglang:num_running_reqs{model_name="m",tp_rank="0"} 3
sglang:num_running_reqs{model_name="m",tp_rank="1"} 3
"""
    reading = parse_load([text])
    assert reading is not None
    assert (reading.queued_per_rank, reading.running_per_rank, reading.shards) == (5.0, 3.0, 1)
    assert reading.kv_usage is None


def test_several_servers_are_separate_shards() -> None:
    joiner = """\
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 0
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 2
"""
    reading = parse_load([TEXT, joiner])
    assert reading is not None and reading.shards == 3
    assert (reading.queued_per_rank, reading.running_per_rank) == (2.0, 6.0)


@pytest.mark.parametrize("texts", [[], [""], ["<html>502 Bad Gateway</html>"],
                                   ['sglang:gen_throughput{dp_rank="0"} 3\n']])
def test_no_reading_without_the_request_gauges(texts: list[str]) -> None:
    assert parse_load(texts) is None
