"""Custom ops (``torch.ops.lfmspark.*``): Triton kernels on CUDA, plain-PyTorch references on CPU.

Importing this package registers every op. A module holds one op (or a few sharing one kernel):
its Triton kernel, launcher, reference implementation and ``torch.library`` registration, side by
side. Families share private kernel helpers within their folder: ``linear/`` (the products of 1-16
rows), ``attention/`` (the caches' writes and attention), ``markov_walk/`` (the draft's greedy
Markov walk). ``routing.py`` decides which kernel a model's product, norm, attention window or walk
runs; ``_dispatch.py`` how the kernels launch (Triton on CPU for tests, programmatic dependent launch).
"""

# importing the modules registers the ops
from . import (argmax_rows, attention, exact_norm, linear, markov_walk, moe, moe_route, row_mass,  # noqa: F401
               short_conv, threshold_filter)
from .attention.rope import apply_rope, gather_cos_sin, rope_cos_sin_table

__all__ = ["apply_rope", "gather_cos_sin", "rope_cos_sin_table"]
