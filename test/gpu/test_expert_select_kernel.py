"""Triton mask-aware expert selection against the torch reference, in and out of CUDA graphs."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_elastic_ep_kernels import (
    build_replica_table,
    select_physical_experts,
    select_physical_experts_reference,
)

pytestmark = pytest.mark.usefixtures("cuda")


def random_case(
    g: torch.Generator,
    T: int,
    K: int,
    L: int,
    R: int,
    P: int,
    M: int,
    ids_dtype: torch.dtype,
    mask_dtype: torch.dtype,
) -> list[torch.Tensor]:
    topk = torch.randint(-1, L + 1, (T, K), generator=g).to(ids_dtype)
    counts = torch.randint(0, R + 2, (L,), generator=g).to(torch.int32)
    table = torch.randint(-1, P + 1, (L, R), generator=g).to(torch.int32)
    s2r = torch.randint(-1, M + 1, (P,), generator=g).to(torch.int32)
    mask = torch.randint(0, 2, (M,), generator=g)
    mask = mask.bool() if mask_dtype == torch.bool else mask.to(mask_dtype)
    return [a.cuda() for a in (topk, table, counts, s2r, mask)]


def assert_same(args: list[torch.Tensor]) -> None:
    kern = select_physical_experts(*args)
    ref = select_physical_experts_reference(*args)
    ref_cpu = select_physical_experts_reference(*(a.cpu() for a in args))
    torch.cuda.synchronize()
    assert kern[0].dtype == args[0].dtype and kern[1].dtype == torch.bool
    assert torch.equal(kern[0], ref[0]), "physical ids differ from the reference"
    assert torch.equal(kern[1], ref[1]), "flags differ from the reference"
    assert torch.equal(kern[0].cpu(), ref_cpu[0]) and torch.equal(kern[1].cpu(), ref_cpu[1])


@pytest.mark.parametrize(
    "ids_dtype,mask_dtype",
    list(itertools.product((torch.int32, torch.int64), (torch.int32, torch.bool))),
)
def test_random_inputs_match_reference(ids_dtype: torch.dtype, mask_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1234)
    shapes = [
        (1, 8, 256, 2, 288, 16),
        (7, 1, 3, 1, 3, 2),
        (128, 8, 256, 4, 288, 16),
        (1000, 9, 64, 3, 100, 8),
        (4096, 2, 17, 8, 40, 5),
        (65536, 8, 256, 2, 288, 16),
    ]
    for T, K, L, R, P, M in shapes:
        assert_same(random_case(g, T, K, L, R, P, M, ids_dtype, mask_dtype))


def test_edge_cases() -> None:
    slots = [[2 * e, 2 * e + 1] for e in range(8)]
    table, counts = build_replica_table(slots, device="cuda")
    s2r = torch.tensor([(e + i) % 4 for e in range(8) for i in range(2)], device="cuda")
    topk = torch.randint(-1, 8, (300, 8), device="cuda")
    for mask in ([0, 0, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1], [1, 0, 1, 0]):
        m = torch.tensor(mask, dtype=torch.int32, device="cuda")
        assert_same([topk, table, counts, s2r, m])
    dead = torch.zeros(4, dtype=torch.int32, device="cuda")
    phys, flag = select_physical_experts(topk, table, counts, s2r, dead)
    assert bool((phys == -1).all())
    assert torch.equal(flag, (topk >= 0).any(dim=1))
    # no tokens, no expert at all, K = 0
    empty = torch.empty((0, 8), dtype=torch.int64, device="cuda")
    phys, flag = select_physical_experts(empty, table, counts, s2r, dead)
    assert phys.shape == (0, 8) and flag.shape == (0,)
    none = torch.full((5, 8), -1, device="cuda")
    phys, flag = select_physical_experts(none, table, counts, s2r, dead)
    assert bool((phys == -1).all()) and not bool(flag.any())
    assert_same([torch.empty((4, 0), dtype=torch.int64, device="cuda"), table, counts, s2r, dead])


def test_strided_inputs() -> None:
    g = torch.Generator().manual_seed(5)
    topk, table, counts, s2r, mask = random_case(
        g, 500, 16, 64, 6, 200, 8, torch.int64, torch.int32
    )
    per_layer = torch.stack([table, table.flip(0)])  # [layers, L, R]: one layer's view
    assert_same([topk[:, ::2], per_layer[1], counts, s2r, mask])
    assert_same([topk.t().contiguous().t()[:, :8], table[:, ::2], counts, s2r, mask])


def test_spread_over_live_replicas() -> None:
    slots = [[4 * e + i for i in range(4)] for e in range(4)]
    table, counts = build_replica_table(slots, device="cuda")
    s2r = torch.tensor([i for _ in range(4) for i in range(4)], device="cuda")
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32, device="cuda")
    topk = torch.zeros((30000, 1), dtype=torch.int64, device="cuda")
    phys, flag = select_physical_experts(topk, table, counts, s2r, mask)
    ranks = s2r[phys.flatten()]
    share = torch.bincount(ranks, minlength=4).float() / ranks.numel()
    assert share[1].item() == 0.0 and not bool(flag.any())
    assert torch.allclose(share[[0, 2, 3]], torch.full((3,), 1 / 3, device="cuda"), atol=0.02)


def test_cuda_graph_replay_honours_mask_changed_in_place() -> None:
    g = torch.Generator().manual_seed(9)
    T, K, L, R, P, M = 4096, 8, 256, 2, 288, 16
    topk, table, counts, s2r, mask = random_case(g, T, K, L, R, P, M, torch.int64, torch.int32)
    counts.fill_(R)
    table.copy_((torch.arange(L * R) % P).view(L, R).to(torch.int32))  # 2 slots per expert
    s2r.copy_((torch.arange(P) % M).cuda().to(torch.int32))
    mask.fill_(1)
    out = torch.empty_like(topk)
    flag = torch.empty(T, dtype=torch.bool, device="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for _ in range(2):
            select_physical_experts(topk, table, counts, s2r, mask, out=out, flag_out=flag)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_physical_experts(topk, table, counts, s2r, mask, out=out, flag_out=flag)

    masks = [
        [1] * M,
        [1, 0] * (M // 2),
        [0] * (M - 1) + [1],
        [0] * M,
        [1] * M,
    ]
    for i, new_mask in enumerate(masks):
        mask.copy_(torch.tensor(new_mask, dtype=torch.int32))  # in place: same address
        if i == 4:
            topk.copy_(torch.randint(-1, L, (T, K), generator=g))  # new routing, same graph
        graph.replay()
        torch.cuda.synchronize()
        ref_phys, ref_flag = select_physical_experts_reference(topk, table, counts, s2r, mask)
        assert torch.equal(out, ref_phys), f"replay {i}: physical ids differ"
        assert torch.equal(flag, ref_flag), f"replay {i}: flags differ"
        chosen = out[out >= 0]
        assert bool((mask[s2r[chosen]] != 0).all()), f"replay {i}: a dead rank was chosen"
        if i == 3:  # every rank dead
            assert bool((out == -1).all())
            assert torch.equal(flag, (topk >= 0).any(dim=1))


def test_launch_has_no_host_sync() -> None:
    g = torch.Generator().manual_seed(2)
    args = random_case(g, 128, 8, 256, 2, 288, 16, torch.int64, torch.int32)
    select_physical_experts(*args)  # compile first (compilation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            select_physical_experts(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
