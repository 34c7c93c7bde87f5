"""Per-slot device state (the slots themselves are handed out by runtime/scheduler.py).

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
    def __init__(self, n_slots: int, vocab: int, device: torch.device | str, window: int = 1):
        self.n_slots = n_slots
        self.seq_len = torch.zeros(n_slots + 1, dtype=torch.int64, device=device)
        self.anchor = torch.zeros(n_slots + 1, dtype=torch.int64, device=device)
        # drafts a round may accept per slot (the request's cap; a large number: no cap)
        self.draft_limit = torch.full((n_slots + 1,), NO_DRAFT_LIMIT, dtype=torch.int64, device=device)
        # ``window``: the widest verify window (the structured-output masks hold one row per column)
        self.sampling = SlotSampling.allocate(n_slots + 1, vocab, device, window)

    @staticmethod
    def gather_index(slots: torch.Tensor) -> torch.Tensor:
        """Index for reading per-slot values of a batch (padding rows read slot 0, ignored)."""
        return slots.clamp(min=0)

    def scatter_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Index for writing per-slot values of a batch (padding rows write the trash entry)."""
        return torch.where(slots >= 0, slots, self.n_slots)
