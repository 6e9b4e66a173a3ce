"""The torch reference of mask-aware expert selection (the CPU path), against a plain-Python
oracle of the documented rule, plus its edge cases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

KERNEL_ROOT = Path(__file__).resolve().parents[2] / "sgl-kernel"
try:
    import sglang_elastic_ep_kernels  # noqa: F401
except ImportError:  # until sgl-kernel/ is a package root of the install
    sys.path.insert(0, str(KERNEL_ROOT))

from sglang_elastic_ep_kernels import (  # noqa: E402
    build_replica_table,
    select_physical_experts,
    select_physical_experts_reference,
    token_hash,
)

MASK32 = 0xFFFFFFFF


def py_hash(t: int, k: int) -> int:
    h = (t * 0x9E3779B1 + k * 0x7FEB352D + 0x165667B1) & MASK32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & MASK32
    h ^= h >> 12
    h = (h * 0x297A2D39) & MASK32
    h ^= h >> 15
    return h


def oracle(
    topk: list[list[int]],
    table: list[list[int]],
    counts: list[int],
    slot_to_rank: list[int],
    mask: list[int],
) -> tuple[list[list[int]], list[bool]]:
    out, flags = [], []
    for t, row in enumerate(topk):
        o, flag = [], False
        for k, e in enumerate(row):
            if e < 0 or e >= len(table):
                o.append(-1)
                continue
            live = []
            for j in range(min(max(counts[e], 0), len(table[e]))):
                s = table[e][j]
                if 0 <= s < len(slot_to_rank):
                    r = slot_to_rank[s]
                    if 0 <= r < len(mask) and mask[r]:
                        live.append(s)
            if not live:
                o.append(-1)
                flag = True
            else:
                o.append(live[py_hash(t, k) % len(live)])
        out.append(o)
        flags.append(flag)
    return out, flags


def random_case(
    g: torch.Generator, T: int, K: int, L: int, R: int, P: int, M: int
) -> tuple[torch.Tensor, ...]:
    topk = torch.randint(-1, L + 1, (T, K), generator=g)  # includes -1 and out-of-range L
    counts = torch.randint(0, R + 2, (L,), generator=g).to(torch.int32)  # may exceed R
    table = torch.randint(-1, P + 1, (L, R), generator=g).to(torch.int32)  # -1 and P invalid
    slot_to_rank = torch.randint(-1, M + 1, (P,), generator=g).to(torch.int32)
    mask = torch.randint(0, 2, (M,), generator=g).to(torch.int32)
    return topk, table, counts, slot_to_rank, mask


def check_against_oracle(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    phys, flag = select_physical_experts_reference(*args)
    exp_phys, exp_flag = oracle(*(a.tolist() for a in args))
    assert phys.tolist() == exp_phys
    assert flag.tolist() == exp_flag
    assert phys.dtype == args[0].dtype and flag.dtype == torch.bool
    return phys, flag


@pytest.mark.parametrize("seed", range(12))
def test_random_inputs_match_the_oracle(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    T = [1, 3, 17, 64][seed % 4]
    K = [1, 2, 8, 9][seed % 4]
    args = list(random_case(g, T, K, L=1 + seed * 3, R=1 + seed % 4, P=5 + seed, M=1 + seed % 5))
    if seed % 2:
        args[0] = args[0].to(torch.int32)
    check_against_oracle(*args)


def mesh(
    num_logical: int = 8, replicas: int = 2, ranks: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e has replicas on ranks (e + i) % ranks, slot = e * replicas + i."""
    slots = [[e * replicas + i for i in range(replicas)] for e in range(num_logical)]
    table, counts = build_replica_table(slots)
    s2r = torch.tensor(
        [(e + i) % ranks for e in range(num_logical) for i in range(replicas)], dtype=torch.int32
    )
    return table, counts, s2r


def test_all_replicas_of_an_expert_dead_flags_only_its_tokens() -> None:
    table, counts, s2r = mesh()
    mask = torch.ones(4, dtype=torch.int32)
    mask[1] = mask[2] = 0  # expert 1 lives on ranks 1 and 2 only
    topk = torch.tensor([[1, 0], [0, 3], [5, 1], [-1, 4]])
    phys, flag = check_against_oracle(topk, table, counts, s2r, mask)
    assert flag.tolist() == [True, False, True, False]
    assert phys[0, 0] == -1 and phys[2, 1] == -1
    live = phys[phys >= 0]
    assert bool((mask[s2r[live.long()].long()] == 1).all())


def test_one_rank_alive() -> None:
    table, counts, s2r = mesh(num_logical=8, replicas=2, ranks=4)
    mask = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    topk = torch.arange(8).view(1, 8).repeat(3, 1)
    phys, flag = check_against_oracle(topk, table, counts, s2r, mask)
    # Expert e lives on ranks e % 4 and (e + 1) % 4: experts 1, 2, 5, 6 keep a replica on rank 2.
    assert phys[0].tolist() == [-1, 3, 4, -1, -1, 11, 12, -1]
    assert flag.tolist() == [True, True, True]


def test_no_tokens() -> None:
    table, counts, s2r = mesh()
    mask = torch.ones(4, dtype=torch.int32)
    for dtype in (torch.int32, torch.int64):
        phys, flag = select_physical_experts_reference(
            torch.empty((0, 8), dtype=dtype), table, counts, s2r, mask
        )
        assert phys.shape == (0, 8) and phys.dtype == dtype
        assert flag.shape == (0,) and flag.dtype == torch.bool


def test_minus_one_means_no_expert_and_no_flag() -> None:
    table, counts, s2r = mesh()
    mask = torch.zeros(4, dtype=torch.int32)  # everything dead
    topk = torch.full((5, 4), -1)
    phys, flag = check_against_oracle(topk, table, counts, s2r, mask)
    assert bool((phys == -1).all()) and not bool(flag.any())


def test_all_alive_spreads_evenly_over_replicas() -> None:
    table, counts, s2r = mesh(num_logical=4, replicas=4, ranks=4)
    mask = torch.ones(4, dtype=torch.int32)
    topk = torch.zeros((4096, 2), dtype=torch.int64)  # everyone wants expert 0
    phys, flag = select_physical_experts_reference(topk, table, counts, s2r, mask)
    share = torch.bincount(phys.flatten(), minlength=4)[:4].float() / phys.numel()
    assert not bool(flag.any())
    assert torch.allclose(share, torch.full((4,), 0.25), atol=0.03), share


def test_dead_rank_load_moves_to_the_survivors() -> None:
    table, counts, s2r = mesh(num_logical=4, replicas=4, ranks=4)
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    topk = torch.zeros((3000, 1), dtype=torch.int64)
    phys, _ = select_physical_experts_reference(topk, table, counts, s2r, mask)
    ranks = s2r[phys.flatten()]
    assert 1 not in ranks.tolist()
    share = torch.bincount(ranks, minlength=4).float() / ranks.numel()
    assert torch.allclose(share[[0, 2, 3]], torch.full((3,), 1 / 3), atol=0.04), share


def test_bool_mask_equals_int_mask_and_rule_is_deterministic() -> None:
    g = torch.Generator().manual_seed(7)
    topk, table, counts, s2r, mask = random_case(g, 50, 8, 32, 3, 60, 8)
    a = select_physical_experts_reference(topk, table, counts, s2r, mask)
    b = select_physical_experts_reference(topk, table, counts, s2r, mask.bool())
    c = select_physical_experts_reference(topk.clone(), table, counts, s2r, mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0])


def test_degenerate_tables() -> None:
    topk = torch.tensor([[0, -1], [1, 2]])
    mask = torch.ones(2, dtype=torch.int32)
    for table, counts, s2r in (
        (torch.empty((3, 0), dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(1)),
        (torch.full((3, 2), -1, dtype=torch.int32), torch.full((3,), 2), torch.zeros(1)),
        (torch.zeros((3, 1), dtype=torch.int32), torch.ones(3), torch.empty(0)),
    ):
        phys, flag = select_physical_experts_reference(
            topk, table, counts.to(torch.int32), s2r.to(torch.int32), mask
        )
        assert phys.tolist() == [[-1, -1], [-1, -1]]
        assert flag.tolist() == [True, True]


def test_dispatcher_uses_the_reference_on_cpu_and_fills_out() -> None:
    g = torch.Generator().manual_seed(3)
    topk, table, counts, s2r, mask = random_case(g, 9, 4, 10, 2, 20, 4)
    out = torch.empty_like(topk)
    flag_out = torch.empty(9, dtype=torch.bool)
    phys, flag = select_physical_experts(topk, table, counts, s2r, mask, out=out, flag_out=flag_out)
    ref = select_physical_experts_reference(topk, table, counts, s2r, mask)
    assert phys is out and flag is flag_out
    assert torch.equal(out, ref[0]) and torch.equal(flag_out, ref[1])
    with pytest.raises(ValueError):
        select_physical_experts(topk, table, counts, s2r, mask, backend="cuda")


def test_input_validation() -> None:
    table, counts, s2r = mesh()
    mask = torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError):
        select_physical_experts_reference(
            torch.zeros(3, dtype=torch.int64), table, counts, s2r, mask
        )
    with pytest.raises(ValueError):
        select_physical_experts_reference(torch.zeros((3, 2)), table, counts, s2r, mask)
    with pytest.raises(ValueError):
        select_physical_experts_reference(
            torch.zeros((3, 2), dtype=torch.int64), table, counts[:-1], s2r, mask
        )


def test_hash_matches_python() -> None:
    t = torch.tensor([0, 1, 2**31 - 1, 123456789]).view(-1, 1)
    k = torch.arange(9).view(1, -1)
    h = token_hash(t, k)
    for i, tv in enumerate(t.flatten().tolist()):
        for kv in range(9):
            assert h[i, kv].item() == py_hash(tv, kv)


def test_triton_kernel_matches_reference_under_the_interpreter() -> None:
    """Runs the Triton kernel's code on the CPU (TRITON_INTERPRET=1) in a fresh process."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(KERNEL_ROOT)!r})
        from sglang_elastic_ep_kernels import select_physical_experts_reference as ref
        from sglang_elastic_ep_kernels._expert_select_triton import (
            select_physical_experts_triton as tri,
        )
        g = torch.Generator().manual_seed(0)
        n = 0
        cases = [(5, 8, 16, 3, 40, 4), (33, 3, 7, 1, 7, 2), (64, 9, 256, 4, 288, 16),
                 (1, 1, 1, 1, 1, 1), (300, 8, 256, 2, 288, 16)]
        for T, K, L, R, P, M in cases:
            for dt in (torch.int32, torch.int64):
                for mdt in (torch.int32, torch.bool):
                    topk = torch.randint(-1, L + 1, (T, K), generator=g).to(dt)
                    counts = torch.randint(0, R + 2, (L,), generator=g).to(torch.int32)
                    table = torch.randint(-1, P + 1, (L, R), generator=g).to(torch.int32)
                    s2r = torch.randint(-1, M + 1, (P,), generator=g).to(torch.int32)
                    mask = torch.randint(0, 2, (M,), generator=g).to(mdt)
                    a = ref(topk, table, counts, s2r, mask)
                    b = tri(topk, table, counts, s2r, mask)
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (T, K, L, R)
                    n += 1
        print("interpreted cases", n)
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreted cases 20" in proc.stdout
