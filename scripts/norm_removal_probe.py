"""Probe for what the several-row add + RMSNorm kernels cost the speculative round (docs/benchmarks.md,
session 14): run ``lfmspark bench`` with them removed. Timing only: the numbers it produces are wrong.

    python scripts/norm_removal_probe.py MODE bench --preset lfm2.5-1.2b --batch-sizes 1 --runs 2 \\
        --no-hf --no-phase-split --imposed-acceptance 0.8 --profile-dir DIR

On 2-16 CUDA rows outside decode steps (the batch-1 verify and the draft's block), MODE:
- ``none``: unchanged (the baseline of the same process layout);
- ``remaining`` (run it with ``LFMSPARK_NORM_CARRY=0``, which it measured the code before; with the
  carry on it removes only what the carry leaves): the add + RMSNorm kernels the norm epilogue
  (``LFMSPARK_NORM_EPILOGUE``) leaves: the
  target layers' ``operator_norm`` (its pending add and norm skipped, the projection fed the pending
  output) and the draft layers' ``input_layernorm`` (identity; its add stays);
- ``all``: those, and the feed-forward norms of both models as well (the mixer's output projection
  fed straight to the SwiGLU, no add). Session 14 ran this mode's equivalent on the code before the
  norm epilogue (commit b8a0076; the draft's adds stayed): the upper bound of removing them.
"""

from __future__ import annotations

import sys

import torch

from lfmspark.models import dspark, layers, lfm2
from lfmspark.runtime.cli import main

MODES = ("none", "remaining", "all")


def _several_rows(t: torch.Tensor) -> bool:
    rows = t.numel() // t.shape[-1]
    return t.is_cuda and 2 <= rows <= 16


def _patch_operator_norms() -> None:
    norm_linear = lfm2.norm_linear

    def skipped(h, delta, norm, proj, fuse=True):
        if fuse or isinstance(delta, layers.NormedCarry) or not _several_rows(h):
            return norm_linear(h, delta, norm, proj, fuse)
        x = h if delta is None else delta
        return x, proj(x)

    lfm2.norm_linear = skipped


def _patch_feed_forward_norms() -> None:
    """Target and draft layers: the mixer's projection straight into the SwiGLU (no add, no norm)."""
    project = layers.project_norm_feed_forward

    def skipped(h, y, proj, norm, feed_forward, fuse=True, next_norm=None):
        if fuse or not _several_rows(y) or not isinstance(feed_forward, layers.SwiGLU):
            return project(h, y, proj, norm, feed_forward, fuse, next_norm)
        x = proj(y)
        return x, feed_forward(x)

    lfm2.project_norm_feed_forward = dspark.project_norm_feed_forward = skipped


def _patch_draft_input_norms() -> None:
    """The draft layers' ``input_layernorm`` becomes the identity on several rows."""
    init, forward = dspark.DraftLayer.__init__, layers.RMSNorm.forward

    def marked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.input_layernorm.probe_skip = True

    def maybe_skipped(self, x):
        return x if getattr(self, "probe_skip", False) and _several_rows(x) else forward(self, x)

    dspark.DraftLayer.__init__ = marked_init
    layers.RMSNorm.forward = maybe_skipped


def apply(mode: str) -> None:
    if mode not in MODES:
        raise SystemExit(f"MODE must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    _patch_operator_norms()
    _patch_draft_input_norms()
    if mode == "all":
        _patch_feed_forward_norms()


if __name__ == "__main__":
    apply(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
