import pytest

from sglang_elastic_ep.core.autoscaler import Autoscaler, AutoscalerConfig, LoadSample

CFG = AutoscalerConfig(
    min_size=2,
    max_size=8,
    target_load=10.0,
    up_ratio=1.5,
    down_ratio=0.5,
    up_checks=3,
    down_checks=4,
    cooldown_s=60.0,
)


def sample(now: float, size: int, per_shard: int, busy: bool = False) -> LoadSample:
    shards = size
    return LoadSample(
        now=now, current_size=size, queued=[per_shard] * shards, running=[0] * shards, busy=busy
    )


def test_sustained_high_load_scales_up_to_the_needed_size() -> None:
    a = Autoscaler(CFG)
    assert a.decide(sample(0, 2, 30)) is None
    assert a.decide(sample(1, 2, 30)) is None
    # total 60 requests / 10 per shard -> 6 ranks
    assert a.decide(sample(2, 2, 30)) == 6


def test_scale_up_is_capped_at_max() -> None:
    a = Autoscaler(CFG)
    decisions = [a.decide(sample(t, 4, 100)) for t in range(3)]
    assert decisions == [None, None, 8]


def test_a_spike_shorter_than_up_checks_does_nothing() -> None:
    a = Autoscaler(CFG)
    loads = [30, 30, 5, 30, 30, 5]
    assert [a.decide(sample(t, 2, x)) for t, x in enumerate(loads)] == [None] * 6


def test_load_inside_the_hysteresis_band_never_scales() -> None:
    a = Autoscaler(CFG)
    assert all(a.decide(sample(t, 4, 12)) is None for t in range(50))  # 5 < 12 < 15


def test_sustained_low_load_scales_down_one_step_if_it_would_still_fit() -> None:
    a = Autoscaler(CFG)
    decisions = [a.decide(sample(t, 4, 2)) for t in range(4)]
    assert decisions == [None, None, None, 3]


def test_no_scale_down_when_the_smaller_size_would_overload() -> None:
    cfg = AutoscalerConfig(
        min_size=1, max_size=8, target_load=10.0, down_ratio=0.9, down_checks=1, cooldown_s=0
    )
    a = Autoscaler(cfg)
    # 2 shards x 8 = 16 requests; one shard would carry 16 > 10.
    assert a.decide(sample(0, 2, 8)) is None


def test_never_below_min() -> None:
    a = Autoscaler(CFG)
    assert all(a.decide(sample(t, 2, 0)) is None for t in range(20))


def test_cooldown_after_a_decision_and_after_external_operations() -> None:
    a = Autoscaler(CFG)
    for t in range(3):
        a.decide(sample(t, 2, 30))
    # Decided at t=2; still hot at size 6 but cooling down until t=62.
    assert all(a.decide(sample(t, 6, 30)) is None for t in range(3, 62))
    assert a.decide(sample(62, 6, 30)) == 8
    b = Autoscaler(CFG)
    b.notify_operation_finished(now=100.0)
    assert all(b.decide(sample(t, 2, 30)) is None for t in range(100, 160))
    assert b.decide(sample(160, 2, 30)) == 6


def test_busy_resets_streaks() -> None:
    a = Autoscaler(CFG)
    a.decide(sample(0, 2, 30))
    a.decide(sample(1, 2, 30))
    assert a.decide(sample(2, 2, 30, busy=True)) is None
    assert a.decide(sample(3, 2, 30)) is None  # streak restarted
    assert a.decide(sample(4, 2, 30)) is None
    assert a.decide(sample(5, 2, 30)) == 6


def test_sizes_move_in_whole_attention_replicas() -> None:
    cfg = AutoscalerConfig(
        min_size=2, max_size=8, ranks_per_shard=2, target_load=10.0, up_checks=1, cooldown_s=0
    )
    a = Autoscaler(cfg)
    # size 2 = 1 shard with 25 requests -> 3 shards -> 6 ranks
    s = LoadSample(now=0, current_size=2, queued=[25], running=[0])
    assert a.decide(s) == 6


def test_out_of_bounds_size_is_pulled_back() -> None:
    a = Autoscaler(CFG)
    assert a.decide(sample(0, 1, 10)) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_size": 0, "max_size": 4},
        {"min_size": 4, "max_size": 2},
        {"min_size": 2, "max_size": 5, "ranks_per_shard": 2},
        {"min_size": 1, "max_size": 4, "target_load": 0},
        {"min_size": 1, "max_size": 4, "up_ratio": 1.0},
        {"min_size": 1, "max_size": 4, "down_ratio": 1.0},
        {"min_size": 1, "max_size": 4, "up_checks": 0},
        {"min_size": 1, "max_size": 4, "cooldown_s": -1},
    ],
)
def test_bad_config_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AutoscalerConfig(**kwargs)
