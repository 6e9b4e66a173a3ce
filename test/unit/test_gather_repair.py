"""Gathered rows holding values no scheduler sends become idle rows; the fields upstream
derives from the rows follow; live rows are never touched."""

from __future__ import annotations

import pytest
import torch

from sglang_elastic_ep.sglang import gather_repair
from sglang_elastic_ep.sglang.gather_repair import garbage_rows, repair_after_gather

MODES = frozenset({1, 2, 3, 4})  # stand-ins for ForwardMode's values; 4 = idle here
IDLE = [0, 0, 1, 0, 1, 4, 0, 0, 1, 0, 0]


def row(tokens: int, mode: int = 2) -> list[int]:
    return [tokens, tokens, 1, 0, 1, mode, 0, 0, 1, 0, 0]


def test_rows_a_scheduler_can_send_pass() -> None:
    assert garbage_rows([row(3), row(5), IDLE, row(0, mode=1)], MODES) == []


def test_negative_counts_bad_modes_and_flags_are_garbage() -> None:
    bad_flag = row(3)
    bad_flag[2] = 7
    rows = [row(2), row(-1), row(3, mode=0), bad_flag, [1, 2]]
    assert garbage_rows(rows, MODES) == [1, 2, 3, 4]


class FakeInfo:
    """What ``repair_after_gather`` reads of upstream's ``MLPSyncBatchInfo``."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.tp0_info_cpu = torch.tensor(rows, dtype=torch.int64)
        self.global_num_tokens = [r[0] for r in rows]

    def _get_fallback_tensor(self, device: str) -> torch.Tensor:
        return torch.tensor(IDLE)


@pytest.fixture(autouse=True)
def modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather_repair, "_forward_modes", lambda: MODES)


def test_garbage_is_repaired_in_place_and_the_fields_derived_again() -> None:
    info = FakeInfo([row(3), row(5), row(-2)])
    assert repair_after_gather(info) == [2]
    assert info.tp0_info_cpu.tolist() == [row(3), row(5), IDLE]
    assert info.global_num_tokens == [3, 5, 0] and info.global_attention_pairs == [0, 0, 0]
    assert info.is_extend_in_batch is False and info.can_run_decode_cuda_graph is True


def test_a_clean_gather_is_left_alone() -> None:
    info = FakeInfo([row(3), row(5), IDLE])
    assert repair_after_gather(info) == []
    assert info.global_num_tokens == [3, 5, 0]
    assert not hasattr(info, "global_attention_pairs")  # nothing derived again


def test_a_row_check_fails_on_stale_bytes_and_on_a_sum_of_rows() -> None:
    a, b = row(3), row(5, mode=1)
    assert gather_repair.row_check(a) == gather_repair.row_check(list(a))
    summed = [x + y for x, y in zip(a, b, strict=True)]
    check_sum = gather_repair.row_check(a) + gather_repair.row_check(b)
    assert gather_repair.row_check(summed) != check_sum
    stale = [x + 7 for x in a]
    assert gather_repair.row_check(stale) != gather_repair.row_check(a) + 7


def test_only_written_rows_with_a_wrong_check_are_found() -> None:
    def checked(values: list[int]) -> list[int]:
        return [*values, gather_repair.row_check(values)]

    idle = torch.tensor(IDLE + [0])
    good, other = checked(row(3)), checked(row(4))
    broken = list(good)
    broken[0] += 1
    full = torch.tensor([good, IDLE + [0], broken, other])
    found = gather_repair._rows_failing_their_check(full, idle, skip={3})
    assert found == [2]
