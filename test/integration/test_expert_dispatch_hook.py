"""The expert-dispatch hook on SGLang's real metadata classes: live slots only, upstream when off.

Layout used throughout (4 EP ranks x 3 slots, 6 logical experts, 2 layers)::

    layer 0: rank0 [0 1 2] rank1 [3 4 5] rank2 [0 1 3] rank3 [4 2 0]   expert 5 only on rank 1
    layer 1: rank0 [5 4 3] rank1 [2 1 0] rank2 [5 0 1] rank3 [2 3 4]   every expert twice

Rank 1 dies: in layer 0 expert 5 has no replica left (-> -1, counted), every other pick must land
on ranks 0, 2, 3 and on a replica of the right expert. The CPU tests need SGLang; the CUDA test
at the end needs only torch + Triton (it runs on the GPU machine, which has no SGLang).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from sglang_elastic_ep.sglang import expert_dispatch as ed
from sglang_elastic_ep.sglang import nixl_buffer_hooks
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled

NUM_RANKS, NUM_LOCAL, NUM_LOGICAL, CAPACITY = 4, 3, 6, 8
NUM_SLOTS = NUM_RANKS * NUM_LOCAL
P2L = [
    [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 2, 0],
    [5, 4, 3, 2, 1, 0, 5, 0, 1, 2, 3, 4],
]
DEAD = 1
ORPHANS = [(0, 5)]  # (layer, logical expert) with no replica outside rank DEAD
ALGORITHMS = ["static", "dynamic", "dynamic-rank-invariant", "fake"]


def slot_rank(slot: int) -> int:
    return slot // NUM_LOCAL


def replicas(layer: int, expert: int) -> list[int]:
    return [s for s, e in enumerate(P2L[layer]) if e == expert]


def mask(*dead: int) -> torch.Tensor:
    m = torch.zeros(CAPACITY, dtype=torch.int32)
    m[:NUM_RANKS] = 1
    for r in dead:
        m[r] = 0
    return m


def routing(num_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, NUM_LOGICAL, (num_tokens, 4), generator=g, dtype=torch.int32)
    ids[-3:] = -1  # padded rows, as upstream's top-k leaves them before masking
    return ids


# ----------------------------------------------------------------------- SGLang fixtures


@pytest.fixture(scope="module")
def sgl(request: pytest.FixtureRequest) -> dict[str, Any]:
    pytest.importorskip("sglang")
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    tiny_model = request.getfixturevalue("tiny_model")

    def context(backend: str | None) -> Any:
        args = ServerArgs(
            model_path=str(tiny_model), device="cpu", tp_size=NUM_RANKS, ep_size=NUM_RANKS,
            elastic_ep_backend=backend, ep_dispatch_algorithm="dynamic",
        )
        return rc.create_context(args, role="test")

    return {"rc": rc, "off": context(None), "on": context("mooncake")}


@contextmanager
def serving(sgl: dict[str, Any], mode: str, active: torch.Tensor | None) -> Iterator[Any]:
    """Inside SGLang context ``mode``, with real metadata and an ElasticEPState using ``active``."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPState, ElasticEPStateManager
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        _compute_logical_to_all_physical_map,
    )

    rc = sgl["rc"]
    ed.reset_caches()
    with rc.use_context(sgl[mode]):
        p2l = torch.tensor(P2L)
        metadata = ExpertLocationMetadata._init_raw(
            ep_size=NUM_RANKS,
            physical_to_logical_map=p2l,
            logical_to_all_physical_map=_compute_logical_to_all_physical_map(
                p2l, NUM_LOGICAL, NUM_RANKS, None
            ),
            moe_ep_rank=0,
        )
        rc.get_resources().expert_location_metadata = metadata
        state = None
        if active is not None:
            state = ElasticEPState(
                active_ranks=active, last_active_ranks=active.clone(),
                active_ranks_cpu=active.clone(), effective_ep_size=NUM_RANKS,
            )
        saved = ElasticEPStateManager._instance
        ElasticEPStateManager._instance = state
        try:
            yield metadata
        finally:
            ElasticEPStateManager._instance = saved
            rc.get_resources().expert_location_metadata = None
            ed.reset_caches()


def dispatch_info(metadata: Any, layer: int, algorithm: str) -> Any:
    """The real ``ExpertLocationDispatchInfo``, built as ``init_new`` builds it (static: this
    rank's table from upstream's own ``compute_logical_to_rank_dispatch_physical_map``)."""
    from sglang.srt.eplb.expert_location import compute_logical_to_rank_dispatch_physical_map
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    if algorithm == "dynamic":
        info = ExpertLocationDispatchInfo.init_new(layer)  # reads the published config
        assert info is not None and info.ep_dispatch_algorithm == "dynamic"
        info.rank_invariant = False
        return info
    static = None
    if algorithm == "static":
        static = compute_logical_to_rank_dispatch_physical_map(
            metadata.logical_to_all_physical_map, NUM_RANKS, NUM_SLOTS, ep_rank=0
        )[layer]
    return ExpertLocationDispatchInfo(
        ep_dispatch_algorithm=algorithm.removesuffix("-rank-invariant"),
        partial_logical_to_rank_dispatch_physical_map=static,
        partial_logical_to_all_physical_map=metadata.logical_to_all_physical_map[layer],
        partial_logical_to_all_physical_map_num_valid=(
            metadata.logical_to_all_physical_map_num_valid[layer]
        ),
        num_physical_experts=metadata.num_physical_experts,
        rank_invariant=algorithm.endswith("rank-invariant"),
    )


def upstream() -> Callable[..., torch.Tensor]:
    from sglang.srt.eplb import expert_location_dispatch

    return inspect.unwrap(expert_location_dispatch.topk_ids_logical_to_physical)


def installed_hook() -> Callable[..., torch.Tensor]:
    """The function SGLang's HookRegistry installs for our AROUND row (without patching)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return _wrap_fn(upstream(), ed.topk_ids_logical_to_physical, HookType.AROUND)


def both(fn_a: Callable, fn_b: Callable, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Call two dispatch functions on the same RNG state (dynamic/fake draw random numbers)."""
    torch.manual_seed(1234)
    a = fn_a(*args)
    torch.manual_seed(1234)
    b = fn_b(*args)
    return a, b


# ----------------------------------------------------------------------------- tests


def test_gate_follows_elastic_ep_backend(sgl: dict[str, Any]) -> None:
    rc = sgl["rc"]
    with rc.use_context(sgl["off"]):
        assert elastic_ep_enabled() is False
    with rc.use_context(sgl["on"]):
        assert elastic_ep_enabled() is True


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_off_is_exactly_upstream_even_with_a_dead_rank(
    sgl: dict[str, Any], algorithm: str
) -> None:
    ids = routing(64, seed=1)
    with serving(sgl, "off", mask(DEAD)) as metadata:
        for layer in (0, 1):
            info = dispatch_info(metadata, layer, algorithm)
            got, want = both(installed_hook(), upstream(), ids, info)
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert upstream()(ids, None) is ids
            assert installed_hook()(ids, None) is ids
    assert ed.dropped_expert_assignments() == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_on_uses_only_live_slots_and_drops_orphans(sgl: dict[str, Any], algorithm: str) -> None:
    ids = routing(200, seed=2)
    with serving(sgl, "on", mask(DEAD)) as metadata:
        expected_drops = moved = 0
        for layer in (0, 1):
            info = dispatch_info(metadata, layer, algorithm)
            got, want = both(installed_hook(), upstream(), ids, info)
            assert got.shape == ids.shape and got.dtype == ids.dtype
            for t in range(ids.shape[0]):
                for k in range(ids.shape[1]):
                    e, g, w = int(ids[t, k]), int(got[t, k]), int(want[t, k])
                    if e < 0:
                        assert g == w, "padding keeps upstream's value"
                    elif (layer, e) in ORPHANS:
                        assert g == -1
                        expected_drops += 1
                    else:
                        assert 0 <= g < NUM_SLOTS and slot_rank(g) != DEAD
                        assert g in replicas(layer, e), "a replica of the same expert"
                        if slot_rank(w) != DEAD:
                            assert g == w, "a live upstream pick is kept"
                        else:
                            moved += 1
        assert expected_drops > 0 and moved > 0
        assert ed.dropped_expert_assignments() == expected_drops


def test_dead_ranks_share_spreads_over_live_replicas(sgl: dict[str, Any]) -> None:
    ids = torch.zeros(3000, 1, dtype=torch.int32)  # expert 0: slots 0 (rank 0), 6, 11
    with serving(sgl, "on", mask(0)) as metadata:
        info = dispatch_info(metadata, 0, "dynamic-rank-invariant")
        got = installed_hook()(ids, info)
    counts = torch.bincount(got.flatten().long(), minlength=NUM_SLOTS)
    assert counts[0] == 0 and counts[6] + counts[11] == 3000
    assert abs(int(counts[6]) - int(counts[11])) < 300


def test_mask_changes_in_place_apply_on_the_next_call(sgl: dict[str, Any]) -> None:
    ids = routing(128, seed=3)
    active = mask()
    with serving(sgl, "on", active) as metadata:
        info = dispatch_info(metadata, 1, "static")
        hook = installed_hook()
        assert torch.equal(hook(ids, info), upstream()(ids, info)), "all alive: upstream"
        active[2] = 0  # a fault, written into the device mask as NIXL/Mooncake write it
        got = hook(ids, info)
        live = got[ids >= 0]
        assert bool(((live // NUM_LOCAL) != 2).all())
        assert int((upstream()(ids, info)[ids >= 0] // NUM_LOCAL == 2).sum()) > 0
        active[2] = 1  # recovered
        assert torch.equal(hook(ids, info), upstream()(ids, info))
        assert ed.dropped_expert_assignments() == 0


def collapsed_static_info(metadata: Any, layer: int, ep_rank: int) -> Any:
    """What ``init_new`` hands a rank with an a2a backend: each expert's replica list collapsed
    to the rank's nearest replica (upstream's ``_compute_logical_to_all_physical_map`` with a
    ``moe_ep_rank``), tagged with its layer by our ``init_new`` hook."""
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    nearest = []
    for e in range(NUM_LOGICAL):
        slots = replicas(layer, e)
        local = [s for s in slots if slot_rank(s) == ep_rank]
        nearest.append((local or slots)[0])
    table = torch.full((NUM_LOGICAL, NUM_SLOTS), -1, dtype=torch.int64)
    table[:, 0] = torch.tensor(nearest)
    info = ExpertLocationDispatchInfo(
        ep_dispatch_algorithm="static",
        partial_logical_to_rank_dispatch_physical_map=torch.tensor(nearest),
        partial_logical_to_all_physical_map=table,
        partial_logical_to_all_physical_map_num_valid=torch.ones(NUM_LOGICAL, dtype=torch.int64),
        num_physical_experts=metadata.num_physical_experts,
    )
    setattr(info, ed.ELASTIC_LAYER_ATTR, layer)
    return info


def test_collapsed_lists_still_route_to_replicas_on_other_ranks(sgl: dict[str, Any]) -> None:
    """Rank 2's tokens use rank 2's own replicas; rank 2 fails (its mask entry clears): the
    repair picks replicas on ranks 0, 1, 3 from the layer's full list instead of dropping."""
    ids = routing(200, seed=5)
    with serving(sgl, "on", mask(2)) as metadata:
        info = collapsed_static_info(metadata, 1, ep_rank=2)
        assert bool((upstream()(ids, info)[ids >= 0] // NUM_LOCAL == 2).any())
        got = installed_hook()(ids, info)
    valid = ids >= 0
    assert bool((got[valid] >= 0).all()), "layer 1 has every expert twice: nothing dropped"
    assert not bool((got[valid] // NUM_LOCAL == 2).any())
    for t, k in zip(*torch.nonzero(valid, as_tuple=True), strict=True):
        assert int(got[t, k]) in replicas(1, int(ids[t, k]))
    assert ed.dropped_expert_assignments() == 0


def test_a_blocked_rank_loses_the_experts_that_have_replicas_and_keeps_the_rest(
    sgl: dict[str, Any],
) -> None:
    """Rank 1 is blocked for slow experts (alive): in layer 0 its experts 3 and 4 move to their
    replicas on ranks 2 and 3; expert 5 lives only there, so its tokens still go to rank 1
    (slow beats dropped)."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    from sglang_elastic_ep.sglang.expert_health import expert_health_state

    ids = routing(300, seed=6)
    with serving(sgl, "on", mask()) as metadata:
        expert_health_state(ElasticEPStateManager.instance()).block(1 << 1)
        info = collapsed_static_info(metadata, 0, ep_rank=1)
        got = installed_hook()(ids, info)
    valid = ids >= 0
    on_rank_1 = got[valid] // NUM_LOCAL == 1
    assert bool((ids[valid][on_rank_1] == 5).all()), "only expert 5 stays on rank 1"
    assert bool(on_rank_1.any()) and bool((got[valid] >= 0).all())
    assert ed.dropped_expert_assignments() == 0


def test_keyword_call_and_missing_state_pass_through(sgl: dict[str, Any]) -> None:
    ids = routing(32, seed=4)
    with serving(sgl, "on", None) as metadata:  # elastic EP on, state not built yet
        info = dispatch_info(metadata, 0, "static")
        assert torch.equal(installed_hook()(topk_ids=ids, info=info), upstream()(ids, info))
    with serving(sgl, "on", mask(DEAD)) as metadata:
        info = dispatch_info(metadata, 0, "static")
        got = installed_hook()(topk_ids=ids, info=info)
        assert not bool((got[ids >= 0] // NUM_LOCAL == DEAD).any())


def test_coverage_log_at_membership_events(
    sgl: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    with serving(sgl, "on", mask()) as metadata:
        assert ed.orphaned_experts(metadata, mask(DEAD)) == ORPHANS
        assert ed.orphaned_experts(metadata, mask()) == []
        assert ed.orphaned_experts(metadata, mask(0, 2)) == [(0, 1), (1, 5)]
        state = ElasticEPStateManager.instance()
        state.active_ranks[DEAD] = 0
        with caplog.at_level(logging.WARNING, logger=ed.__name__):
            state.sync_active_to_cpu()  # upstream's own method, then our AFTER hook by hand
            nixl_buffer_hooks.hook_after_sync_active_to_cpu(None, state)
        assert any("no replica on an active rank" in r.getMessage() for r in caplog.records)
    with serving(sgl, "off", mask(DEAD)):
        caplog.clear()
        nixl_buffer_hooks.hook_after_sync_active_to_cpu(None, object())  # touches nothing
        assert caplog.records == []


# ------------------------------------------------------------ CUDA: Triton, graphs, compile


def random_layout(g: torch.Generator, num_logical: int, num_ranks: int, local: int):
    """A valid EPLB-like layout: every expert once, the redundant slots at random."""
    num_slots = num_ranks * local
    p2l = torch.cat([torch.arange(num_logical), torch.randint(0, num_logical, (
        num_slots - num_logical,), generator=g)])
    p2l = p2l[torch.randperm(num_slots, generator=g)]
    reps = [[s for s in range(num_slots) if int(p2l[s]) == e] for e in range(num_logical)]
    table = torch.full((num_logical, num_slots), -1, dtype=torch.int64)
    for e, r in enumerate(reps):
        table[e, : len(r)] = torch.tensor(r)
    counts = torch.tensor([len(r) for r in reps], dtype=torch.int64)
    return p2l, table, counts, max(len(r) for r in reps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_triton_repair_graph_capture_and_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    num_logical, num_ranks, local, top_k = 64, 8, 10, 8
    p2l, table, counts, widest = random_layout(g, num_logical, num_ranks, local)
    table, counts, p2l = table.to(dev), counts.to(dev), p2l.to(dev)
    s2r = (torch.arange(num_ranks * local, device=dev) // local).to(torch.int32)
    active = torch.zeros(16, dtype=torch.int32, device=dev)
    active[:num_ranks] = 1

    def upstream_static(ids: torch.Tensor, info: Any) -> torch.Tensor:
        return table[ids.long(), 0].to(ids.dtype)  # first replica, like a static table

    # 1) Triton repair == torch repair == the rules, random masks, no host sync.
    for trial in range(20):
        ids = torch.randint(-1, num_logical, (257, top_k), generator=g, dtype=torch.int32)
        ids, active_t = ids.to(dev), active.clone()
        active_t[torch.randint(0, num_ranks, (trial % 4,), generator=g)] = 0
        phys = upstream_static(ids.clamp(min=0), None)
        c1 = torch.zeros(1, dtype=torch.int64, device=dev)
        c2 = torch.zeros(1, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            a = ed.route_around_inactive_ranks(
                ids, phys, table[:, :widest], counts, s2r, active_t, dropped_counter=c1
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        b = ed.route_around_inactive_ranks(
            ids, phys, table[:, :widest], counts, s2r, active_t, dropped_counter=c2,
            backend="torch",
        )
        assert torch.equal(a, b) and torch.equal(c1, c2)
        ok = ids >= 0
        alive_rank = active_t[(a.clamp(min=0) // local).long()] != 0
        assert bool(((a >= 0) & alive_rank | (a == -1) | ~ok).all())
        assert bool((p2l[a.clamp(min=0).long()] == ids)[ok & (a >= 0)].all())

    # 2) The hook inside torch.compile(dynamic=True), as upstream calls it, then in a CUDA graph
    # replayed after in-place mask changes.
    metadata = SimpleNamespace(
        num_local_physical_experts=local,
        logical_to_all_physical_map_cpu=table.cpu().unsqueeze(0),
    )
    state = SimpleNamespace(active_ranks=active)
    monkeypatch.setattr(ed, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(ed, "elastic_state", lambda: state)
    monkeypatch.setattr(ed, "expert_location_metadata", lambda: metadata)
    ed.reset_caches()
    info = SimpleNamespace(
        partial_logical_to_all_physical_map=table,
        partial_logical_to_all_physical_map_num_valid=counts,
        num_physical_experts=num_ranks * local,
    )

    @torch.compile(dynamic=True)
    def postprocess(ids: torch.Tensor) -> torch.Tensor:
        out = ed.topk_ids_logical_to_physical(upstream_static, ids, info)
        return out + 0

    ids = torch.randint(0, num_logical, (96, top_k), generator=g, dtype=torch.int32).to(dev)
    active[1] = 0
    ref = ed.route_around_inactive_ranks(
        ids, upstream_static(ids, None), table, counts, s2r, active, backend="torch"
    )
    assert torch.equal(postprocess(ids), ref)
    out = postprocess(ids)  # warm (caches filled outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = postprocess(ids)
    for dead in ([], [0], [3, 5], list(range(num_ranks))):
        active[:num_ranks] = 1
        active[dead] = 0
        graph.replay()
        ref = ed.route_around_inactive_ranks(
            ids, upstream_static(ids, None), table, counts, s2r, active, backend="torch"
        )
        assert torch.equal(out, ref), f"dead={dead}"
    active[:num_ranks] = 1
    graph.replay()
    assert torch.equal(out, upstream_static(ids, None)), "all alive: upstream's pick"

    # 3) Cost inside a graph, T=128 decode batch, DeepSeek-like 256 logical / 288 slots.
    g2 = torch.Generator().manual_seed(6)
    _, t2, c2_, w2 = random_layout(g2, 256, 16, 18)
    t2, c2_ = t2.to(dev), c2_.to(dev)
    s2 = (torch.arange(288, device=dev) // 18).to(torch.int32)
    ids2 = torch.randint(0, 256, (128, 8), generator=g2, dtype=torch.int32).to(dev)
    phys2 = t2[ids2.long(), 0].to(torch.int32)
    for width in (1 << (w2 - 1).bit_length(), 288 - 256 + 1):
        def step(width: int = width) -> torch.Tensor:
            return ed.route_around_inactive_ranks(ids2, phys2, t2[:, :width], c2_, s2, active)

        step()
        g3 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g3):
            for _ in range(50):
                step()
        g3.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g3.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"hook tensor path, T=128 K=8 width={width}: "
              f"{start.elapsed_time(end) * 1000 / 1000:.2f} us per call (in a CUDA graph)")
