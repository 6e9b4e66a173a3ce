"""Gaps in SGLang's torch-native attention backend on the CPU engine."""

from __future__ import annotations

from typing import Any


def _padded_seq_len() -> int:
    # Padded DP-attention slots are fake requests of length 1, as in the Intel AMX backend.
    return 1


def add_cpu_graph_fill_value(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TorchNativeAttnBackend.__init__``: DP-attention padding on CPU asks every
    backend for ``get_cpu_graph_seq_len_fill_value``, which only the AMX backend defines."""
    if not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = _padded_seq_len
