"""Custom ops (``torch.ops.lfmspark.*``): Triton kernels on CUDA, plain-PyTorch references on CPU.

Importing this package registers every op. Each module holds one op family: its Triton kernel,
launcher, reference implementation and ``torch.library`` registration (DESIGN §3).
"""

# importing the modules registers the ops
from . import (add_rmsnorm_gemv, argmax_rows, cache_attention, head_argmax, kv_norm_rope_write,  # noqa: F401
               kv_write, markov_walk, moe, short_conv, skinny_linear, swiglu_gemv, window_attention)
from .rope import apply_rope, gather_cos_sin, rope_cos_sin_table

__all__ = ["apply_rope", "gather_cos_sin", "rope_cos_sin_table"]
