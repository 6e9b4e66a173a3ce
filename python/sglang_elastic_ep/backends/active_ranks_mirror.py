"""A host-side mirror of the active-rank mask, so the per-forward poll never syncs with the GPU.

Upstream keeps ``active_ranks`` (one int32 per EP slot, sized to ``--max-ep-size``) on the GPU,
because the MoE dispatcher writes it there after each combine (``query_mask_buffer``) and
Mooncake writes its process group's copy when it evicts a peer. The per-forward checks then read
it from the host: ``ElasticEPState.is_active_equal_last`` (``torch.equal`` of two CUDA tensors,
every forward once ``--elastic-ep-backend`` is set) and ``maybe_recover_ep_ranks``
(``active_ranks.all()``). Each such read waits for all queued GPU work: a host-device sync per
forward.

:class:`ActiveRanksMirror` answers those questions from plain Python state instead:

* Membership events (launch, activate, scale commit, scale-down, recovery) set the mirror
  directly with :meth:`set_mask` / :meth:`set_active`. They happen on the control path, rarely.
* Faults the GPU detects on its own still reach the mirror, without blocking:
  :meth:`refresh_async` queues a non-blocking copy of the device mask into pinned host memory and
  records a CUDA event; :meth:`poll_refresh` folds the copy in once that event has completed
  (``cudaEventQuery``, which never waits). A fault is seen one or two forwards later.

Between membership events the device copy is authoritative (GPU-side fault detection clears a
rank; a recovery sets it again). A snapshot queued before the latest membership event is
discarded, so a stale copy never undoes an event.

Pure torch; no SGLang.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class ActiveRanksMirror:
    """CPU copy of an active-rank mask (1 = rank serving, 0 = not).

    Args:
        size: number of EP slots (``--max-ep-size``).
        initial: the initially active ranks (a 0/1 sequence of ``size`` entries, or a tensor).
        device_mask: the authoritative device tensor that GPU-side fault detection writes, if
            any. Needed only for :meth:`refresh_async`/:meth:`push_to_device`.
    """

    def __init__(
        self,
        size: int,
        initial: Sequence[int] | torch.Tensor | None = None,
        *,
        device_mask: torch.Tensor | None = None,
    ) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if device_mask is not None and device_mask.numel() < size:
            raise ValueError(f"device mask has {device_mask.numel()} slots, need {size}")
        self._size = size
        self._mask: list[int] = [1] * size
        self._last: tuple[int, ...] = tuple(self._mask)
        self._generation = 0
        self._device_mask = device_mask
        self._host_buf: torch.Tensor | None = None
        self._push_buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._pending_generation: int | None = None
        self._snapshot_on_next_set = False
        if device_mask is not None and device_mask.is_cuda:
            # Pinned, so the device-to-host copy can be asynchronous; allocated once.
            self._host_buf = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._push_buf = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._event = torch.cuda.Event()
        if initial is not None:
            self.set_mask(initial)
        self.snapshot()

    # ---------------------------------------------------------------------------- reads (hot)

    @property
    def size(self) -> int:
        return self._size

    @property
    def generation(self) -> int:
        """Bumped by every membership event and every folded-in fault."""
        return self._generation

    def all_active(self, n: int | None = None) -> bool:
        """Whether ranks ``[0, n)`` are all active (``n`` defaults to every slot)."""
        m = self._mask if n is None else self._mask[:n]
        return 0 not in m

    def is_active(self, rank: int) -> bool:
        return self._mask[rank] != 0

    def inactive_ranks(self, n: int | None = None) -> list[int]:
        end = self._size if n is None else n
        return [i for i in range(end) if not self._mask[i]]

    def active_ranks(self, n: int | None = None) -> list[int]:
        end = self._size if n is None else n
        return [i for i in range(end) if self._mask[i]]

    def num_active(self, n: int | None = None) -> int:
        m = self._mask if n is None else self._mask[:n]
        return sum(1 for v in m if v)

    def changed_since_snapshot(self) -> bool:
        """Replaces ``is_active_equal_last`` (negated): did the mask change since ``snapshot``?"""
        return tuple(self._mask) != self._last

    def as_list(self) -> list[int]:
        return list(self._mask)

    def as_tensor(self) -> torch.Tensor:
        """A fresh CPU int32 tensor (what upstream keeps as ``active_ranks_cpu``)."""
        return torch.tensor(self._mask, dtype=torch.int32)

    # ---------------------------------------------------------------------- membership events

    def set_mask(self, values: Sequence[int] | torch.Tensor) -> None:
        """Replace the whole mask (a membership event). ``values`` may be a CPU tensor."""
        if isinstance(values, torch.Tensor):
            if values.is_cuda:
                raise ValueError("set_mask takes host values; a CUDA tensor would need a sync")
            vals = [1 if v else 0 for v in values.reshape(-1).tolist()]
        else:
            vals = [1 if v else 0 for v in values]
        if len(vals) < self._size:
            # Upstream sometimes keeps shorter per-group masks: missing slots are inactive.
            vals = vals + [0] * (self._size - len(vals))
        self._mask = vals[: self._size]
        self._membership_event()

    def set_active(self, ranks: Iterable[int], active: bool = True) -> None:
        """Mark some ranks active or inactive (a membership event)."""
        for r in ranks:
            self._mask[int(r)] = 1 if active else 0
        self._membership_event()

    def snapshot(self) -> None:
        """Replaces ``snapshot_active_to_last``: remember the current mask."""
        self._last = tuple(self._mask)
        self._snapshot_on_next_set = False

    def snapshot_on_next_set(self) -> None:
        """Take the snapshot at the next :meth:`set_mask` (upstream snapshots the device mask
        and only then copies it to the host; the mirror learns the new value at the copy)."""
        self._snapshot_on_next_set = True

    def _membership_event(self) -> None:
        self._generation += 1
        if self._snapshot_on_next_set:
            self.snapshot()

    # ------------------------------------------------------------------- GPU faults, no sync

    def refresh_async(self) -> bool:
        """Queue a non-blocking copy of the device mask on the current stream.

        Does nothing (returns False) while an earlier copy is still in flight, or without a CUDA
        device mask. Never waits for the GPU. Not for use inside CUDA-graph capture.
        """
        if self._device_mask is None or self._event is None or self._host_buf is None:
            return False
        if self._pending_generation is not None:
            return False
        self._host_buf.copy_(self._device_mask[: self._size], non_blocking=True)
        self._event.record()
        self._pending_generation = self._generation
        return True

    def poll_refresh(self) -> bool:
        """Fold in a completed device snapshot, if there is one. Returns whether the mask changed.

        On a CPU device mask this reads it directly (no GPU involved).
        """
        if self._device_mask is not None and not self._device_mask.is_cuda:
            return self._fold(self._device_mask[: self._size].tolist())
        if self._pending_generation is None or self._event is None or self._host_buf is None:
            return False
        if not self._event.query():
            return False
        issued_at = self._pending_generation
        self._pending_generation = None
        if issued_at != self._generation:
            return False  # a membership event came after the copy was queued: stale
        return self._fold(self._host_buf.tolist())

    def _fold(self, device_values: list[int]) -> bool:
        # The device copy is authoritative between membership events (stale copies were
        # rejected above): GPU-side fault detection lowers ranks, recovery raises them.
        vals = [1 if v else 0 for v in device_values[: self._size]]
        vals += self._mask[len(vals) :]
        if vals == self._mask:
            return False
        self._mask = vals
        self._generation += 1
        return True

    def push_to_device(self) -> None:
        """Write the mirror to the device mask (non-blocking, from pinned memory).

        For membership events that the GPU side must see (e.g. a rank activated).
        """
        if self._device_mask is None:
            return
        values = torch.tensor(self._mask, dtype=torch.int32)
        if self._push_buf is None:
            self._device_mask[: self._size].copy_(values)
            return
        # A separate pinned buffer from the one refresh_async copies into. Overwriting it while
        # an earlier push is still queued only makes that push carry newer values.
        self._push_buf.copy_(values)
        self._device_mask[: self._size].copy_(self._push_buf, non_blocking=True)
