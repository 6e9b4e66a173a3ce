"""The pure autoscaling policy: thresholds, windows, hysteresis, cooldown, bounds."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_elastic_ep.core.autoscaler import Autoscaler, AutoscalerConfig, LoadSample

CFG = AutoscalerConfig(
    min_size=2,
    max_size=8,
    scale_up_load=15.0,
    scale_down_load=5.0,
    target_load=10.0,
    kv_scale_up=0.9,
    kv_scale_down=0.5,
    up_window_s=20.0,
    down_window_s=30.0,
    cooldown_s=60.0,
)


def sample(now: float, size: int, load: float | None, **kw: Any) -> LoadSample:
    """``load`` queued+running per rank (split 1/3 queued, 2/3 running)."""
    kw.setdefault("active_ranks", size)
    return LoadSample(
        now=now,
        current_size=size,
        queued_per_rank=None if load is None else load / 3,
        running_per_rank=None if load is None else load * 2 / 3,
        **kw,
    )


def run(policy: Autoscaler, samples: list[LoadSample]) -> list[int | None]:
    return [policy.decide(s).target for s in samples]


def test_sustained_high_load_scales_up_to_the_size_that_meets_the_target() -> None:
    a = Autoscaler(CFG)
    # 2 ranks x 30 = 60 requests; 60 / target 10 -> 6 ranks, once hot for the 20 s window.
    assert run(a, [sample(t, 2, 30) for t in (0, 10, 19)]) == [None, None, None]
    verdict = a.decide(sample(20, 2, 30))
    assert verdict.target == 6
    assert "load 30.00/rank > 15" in verdict.reason
    assert verdict.inputs["load_per_rank"] == 30.0 and verdict.inputs["size"] == 2


def test_scale_up_is_capped_at_max_and_at_max_step_up() -> None:
    assert run(Autoscaler(CFG), [sample(t, 4, 100) for t in (0, 20)]) == [None, 8]
    capped = AutoscalerConfig(min_size=2, max_size=8, up_window_s=0, max_step_up=1)
    assert Autoscaler(capped).decide(sample(0, 2, 100)).target == 3


def test_a_spike_shorter_than_the_window_does_nothing() -> None:
    a = Autoscaler(CFG)
    loads = [(0, 30), (15, 30), (16, 12), (17, 30), (30, 30), (36, 12)]
    assert run(a, [sample(t, 2, x) for t, x in loads]) == [None] * 6


def test_load_inside_the_hysteresis_band_never_scales() -> None:
    a = Autoscaler(CFG)
    verdicts = [a.decide(sample(t, 4, 12)) for t in range(0, 1000, 10)]
    assert all(v.target is None for v in verdicts)
    assert verdicts[-1].reason == "load inside the hysteresis band"


def test_sustained_low_load_scales_down_one_step_if_the_smaller_size_stays_at_target() -> None:
    a = Autoscaler(CFG)
    # 4 ranks x 3 = 12 requests; 3 ranks would carry 4 each (<= 10).
    assert run(a, [sample(t, 4, 3) for t in (0, 10, 29, 30)]) == [None, None, None, 3]


def test_no_scale_down_when_the_smaller_size_would_exceed_the_target() -> None:
    cfg = AutoscalerConfig(min_size=1, max_size=8, scale_up_load=12, scale_down_load=5,
                           target_load=6, down_window_s=0, cooldown_s=0)
    # 2 ranks x 4.5 = 9 requests: one rank would carry 9 > 6.
    verdict = Autoscaler(cfg).decide(sample(0, 2, 4.5))
    assert verdict.target is None and "would carry 9.00/rank" in verdict.reason


def test_after_any_resize_the_new_size_is_inside_the_band_so_it_cannot_flap() -> None:
    """Grow to the target, then the same total load is below the up threshold and above the
    down threshold: the next verdicts are holds for ever."""
    cfg = AutoscalerConfig(min_size=1, max_size=16, scale_up_load=15, scale_down_load=5,
                           target_load=10, up_window_s=0, down_window_s=0, cooldown_s=0)
    a = Autoscaler(cfg)
    total = 90.0
    size = 2
    sizes = [size]
    for t in range(50):
        target = a.decide(sample(t, size, total / size)).target
        if target is not None:
            size = target
            sizes.append(size)
    assert sizes == [2, 9]


def test_kv_cache_usage_alone_scales_up_by_one_step() -> None:
    cfg = AutoscalerConfig(min_size=2, max_size=8, up_window_s=0, cooldown_s=0)
    verdict = Autoscaler(cfg).decide(sample(0, 2, 1.0, kv_usage=0.95))
    assert verdict.target == 3 and "KV usage 0.95 > 0.9" in verdict.reason


def test_high_kv_usage_blocks_a_scale_down_and_no_kv_ignores_it() -> None:
    cfg = AutoscalerConfig(min_size=2, max_size=8, down_window_s=0, cooldown_s=0)
    assert Autoscaler(cfg).decide(sample(0, 4, 0.5, kv_usage=0.7)).target is None
    assert Autoscaler(cfg).decide(sample(0, 4, 0.5, kv_usage=0.2)).target == 3
    no_kv = AutoscalerConfig(min_size=2, max_size=8, down_window_s=0, cooldown_s=0,
                             kv_scale_up=None)
    assert Autoscaler(no_kv).decide(sample(0, 4, 0.5, kv_usage=0.99)).target == 3


def test_no_scale_down_that_would_fill_the_kv_cache_past_mid_band() -> None:
    cfg = AutoscalerConfig(min_size=2, max_size=8, down_window_s=0, cooldown_s=0,
                           kv_scale_up=0.9, kv_scale_down=0.5)
    # 0.45 on 3 ranks would be 0.675 on 2 (<= 0.7, the middle of the band): allowed.
    assert Autoscaler(cfg).decide(sample(0, 3, 0.5, kv_usage=0.45)).target == 2
    # 0.48 on 3 ranks would be 0.72 on 2 > 0.7: held.
    verdict = Autoscaler(cfg).decide(sample(0, 3, 0.5, kv_usage=0.48))
    assert verdict.target is None and "KV cache" in verdict.reason


def test_never_below_min_nor_above_max() -> None:
    a = Autoscaler(CFG)
    verdicts = [a.decide(sample(t, 2, 0)) for t in range(0, 500, 10)]
    assert all(v.target is None for v in verdicts)
    assert "already at --min-size 2" in verdicts[-1].reason
    b = Autoscaler(CFG)
    verdicts = [b.decide(sample(t, 8, 100)) for t in range(0, 500, 10)]
    assert all(v.target is None for v in verdicts)
    assert "already at --max-size 8" in verdicts[-1].reason


def test_a_size_outside_the_bounds_is_pulled_back_without_a_load_signal() -> None:
    assert Autoscaler(CFG).decide(sample(0, 1, None)).target == 2
    assert Autoscaler(CFG).decide(sample(0, 10, None)).target == 8


def test_no_load_signal_holds() -> None:
    verdict = Autoscaler(CFG).decide(sample(0, 4, None))
    assert verdict.target is None and "no load signal" in verdict.reason


def test_cooldown_after_own_decision_and_after_the_servers_last_operation() -> None:
    a = Autoscaler(CFG)
    run(a, [sample(t, 2, 30) for t in (0, 20)])
    # Decided at t=20; still hot at size 6 but quiet until t=80. The window kept running
    # through the cooldown (hot since t=21), so the next step comes as the cooldown ends.
    assert run(a, [sample(t, 6, 30) for t in range(21, 80)]) == [None] * 59
    assert a.decide(sample(80, 6, 30)).target == 8

    b = Autoscaler(CFG)
    finished = {"last_finished_at": 100.0}
    assert run(b, [sample(t, 2, 30, **finished) for t in range(100, 160)]) == [None] * 60
    assert b.decide(sample(160, 2, 30, **finished)).target == 6  # hot since 100, quiet till 160


def test_busy_restarts_the_window() -> None:
    a = Autoscaler(CFG)
    a.decide(sample(0, 2, 30))
    assert a.decide(sample(15, 2, 30, busy=True)).target is None
    assert run(a, [sample(t, 2, 30) for t in (16, 35, 36)]) == [None, None, 6]


def test_sizes_move_in_whole_steps() -> None:
    cfg = AutoscalerConfig(min_size=2, max_size=8, step=2, target_load=10, scale_up_load=15,
                           scale_down_load=5, up_window_s=0, cooldown_s=0)
    # 2 ranks x 25 = 50 requests -> 5 ranks -> rounded up to whole steps: 6
    assert Autoscaler(cfg).decide(sample(0, 2, 25)).target == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_size": 0, "max_size": 4},
        {"min_size": 4, "max_size": 2},
        {"min_size": 2, "max_size": 5, "step": 2},
        {"min_size": 1, "max_size": 4, "scale_up_load": 2, "scale_down_load": 2},
        {"min_size": 1, "max_size": 4, "target_load": 1.0},
        {"min_size": 1, "max_size": 4, "target_load": 9.0},
        {"min_size": 1, "max_size": 4, "kv_scale_up": 0.4},
        {"min_size": 1, "max_size": 4, "kv_scale_up": 1.5},
        {"min_size": 1, "max_size": 4, "up_window_s": -1},
        {"min_size": 1, "max_size": 4, "cooldown_s": -1},
        {"min_size": 2, "max_size": 4, "step": 2, "max_step_up": 3},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AutoscalerConfig(**kwargs)
