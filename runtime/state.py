"""Per-slot device state and the host-side slot allocator (DESIGN §4).

Per slot, on the device: the committed length ``s`` (tokens whose target KV, conv state and draft
context are stored), the anchor token ``x0`` (the last token produced, not yet in any cache) and
the request's sampling parameters and the most drafts a round may accept for it
(``SamplingParams.max_speculative_tokens``). Every per-slot tensor has one extra **trash** entry at index
``n_slots``: padding rows (slot ``-1``) scatter their results there, so a step never needs a
host-side branch to skip them.
"""

from __future__ import annotations

import torch

from .sampling import SlotSampling

NO_DRAFT_LIMIT = 1 << 30


class SlotState:
    def __init__(self, n_slots: int, vocab: int, device: torch.device | str):
        self.n_slots = n_slots
        self.seq_len = torch.zeros(n_slots + 1, dtype=torch.int64, device=device)
        self.anchor = torch.zeros(n_slots + 1, dtype=torch.int64, device=device)
        # drafts a round may accept per slot (the request's cap; a large number: no cap)
        self.draft_limit = torch.full((n_slots + 1,), NO_DRAFT_LIMIT, dtype=torch.int64, device=device)
        self.sampling = SlotSampling.allocate(n_slots + 1, vocab, device)

    @staticmethod
    def gather_index(slots: torch.Tensor) -> torch.Tensor:
        """Index for reading per-slot values of a batch (padding rows read slot 0, ignored)."""
        return slots.clamp(min=0)

    def scatter_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Index for writing per-slot values of a batch (padding rows write the trash entry)."""
        return torch.where(slots >= 0, slots, self.n_slots)


class SlotsFullError(RuntimeError):
    pass


class SlotPool:
    """Host-side free list of state slots. Slots are taken at admission and returned at finish,
    cancel or error; ``in_use`` lets tests assert that none leaked."""

    def __init__(self, n_slots: int):
        self._free = list(range(n_slots - 1, -1, -1))
        self.n_slots = n_slots

    def acquire(self) -> int:
        if not self._free:
            raise SlotsFullError("all slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.n_slots:
            raise RuntimeError(f"slot {slot} released twice or out of range")
        self._free.append(slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.n_slots - len(self._free)
