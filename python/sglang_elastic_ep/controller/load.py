"""The load signal from SGLang's Prometheus ``/metrics`` text."""

from __future__ import annotations

from collections.abc import Iterable

from sglang_elastic_ep.core.controller import LoadReading

QUEUED = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
KV_USAGE = "sglang:token_usage"
_WANTED = (QUEUED, RUNNING, KV_USAGE)


def parse_load(texts: Iterable[str]) -> LoadReading | None:
    """Means per shard over every ``/metrics`` text given; None when none reports the load.

    A shard is one attention DP rank (the ``dp_rank`` label; the whole server without it).
    Several series of one shard (its TP ranks) repeat the same queue, so the largest is
    taken. Each server's ``/metrics`` shows only its own schedulers (a joiner that is its own
    server has its own), and the DP router balances requests over shards, so the mean over
    the shards read stands for every active rank.
    """
    # Imported here: prometheus_client must not load in a process before SGLang sets up its
    # multiprocess metrics (the CLI shares modules with the server side).
    from prometheus_client.parser import text_string_to_metric_families

    per_shard: dict[str, dict[tuple[int, str], float]] = {name: {} for name in _WANTED}
    for source, text in enumerate(texts):
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:  # not Prometheus text (an error page): no reading from it
            continue
        for family in families:
            if family.name not in per_shard:
                continue
            shards = per_shard[family.name]
            for sample in family.samples:
                if sample.name != family.name or sample.value != sample.value:  # NaN
                    continue
                key = (source, sample.labels.get("dp_rank", ""))
                shards[key] = max(shards.get(key, float("-inf")), float(sample.value))

    def mean(name: str) -> float | None:
        values = per_shard[name].values()
        return sum(values) / len(values) if values else None

    queued, running = mean(QUEUED), mean(RUNNING)
    if queued is None and running is None:
        return None
    shards = len(set(per_shard[QUEUED]) | set(per_shard[RUNNING]))
    return LoadReading(queued, running, mean(KV_USAGE), shards)
