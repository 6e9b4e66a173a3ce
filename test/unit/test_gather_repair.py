"""Rows a peer dying mid-gather left as garbage become idle rows; this rank's own row is
what it sent; the fields upstream derives from the rows follow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.sglang import gather_repair
from sglang_elastic_ep.sglang.gather_repair import garbage_rows, repair_after_gather

MODES = frozenset({1, 2, 3, 4})  # stand-ins for ForwardMode's values; 4 = idle here
IDLE = [0, 0, 1, 0, 1, 4, 0, 0, 1, 0, 0]


def row(tokens: int, mode: int = 2) -> list[int]:
    return [tokens, tokens, 1, 0, 1, mode, 0, 0, 1, 0, 0]


def test_rows_a_scheduler_can_send_pass() -> None:
    rows = [row(3), row(5), IDLE]
    assert garbage_rows(rows, MODES, 0, row(3), IDLE) == []
    assert garbage_rows(rows, MODES, 2, row(7), IDLE) == []  # masked to idle by upstream


def test_out_of_range_values_and_an_own_row_that_changed_are_garbage() -> None:
    negative = row(-1)
    bad_mode = row(3, mode=0)
    bad_flag = row(3)
    bad_flag[2] = 7
    rows = [row(2), negative, bad_mode, bad_flag, row(4)]
    assert garbage_rows(rows, MODES, 4, row(5), IDLE) == [1, 2, 3, 4]


class FakeInfo:
    """What ``repair_after_gather`` reads of upstream's ``MLPSyncBatchInfo``."""

    def __init__(self, rows: list[list[int]], own: list[int]) -> None:
        self.tp0_info_cpu = torch.tensor(rows, dtype=torch.int64)
        self.tp_size = self.cp_size = 1
        self._own = own
        self.global_num_tokens = [r[0] for r in rows]

    def _get_local_tensor(self, device: str) -> torch.Tensor:
        return torch.tensor(self._own)

    def _get_fallback_tensor(self, device: str) -> torch.Tensor:
        return torch.tensor(IDLE)


@pytest.fixture
def rank_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather_repair, "_forward_modes", lambda: MODES)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)


@pytest.mark.usefixtures("rank_1")
def test_garbage_is_repaired_in_place_and_the_fields_derived_again() -> None:
    # Rank 1 sent 5 tokens; the gather gave it 4 (a partial sum) and rank 2 a negative count.
    info = FakeInfo([row(3), row(4), row(-2)], own=row(5))
    assert repair_after_gather(info, group=SimpleNamespace()) == [1, 2]
    assert info.tp0_info_cpu.tolist() == [row(3), row(5), IDLE]
    assert info.global_num_tokens == [3, 5, 0] and info.global_attention_pairs == [0, 0, 0]
    assert info.is_extend_in_batch is False and info.can_run_decode_cuda_graph is True


@pytest.mark.usefixtures("rank_1")
def test_a_clean_gather_is_left_alone() -> None:
    info = FakeInfo([row(3), row(5), IDLE], own=row(5))
    assert repair_after_gather(info, group=SimpleNamespace()) == []
    assert info.global_num_tokens == [3, 5, 0]
    assert not hasattr(info, "global_attention_pairs")  # nothing derived again
