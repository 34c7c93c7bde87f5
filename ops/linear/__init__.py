"""``x @ W^T`` on 1-16 rows, streaming the weights once: ``skinny_linear`` (and its SwiGLU, pair and
add + norm epilogue variants, one kernel) and ``add_rmsnorm_gemv`` (one row with the residual add and
RMSNorm as its prologue). ops/routing.py says which rows take them. ``exact_linear``: every row with
the same arithmetic whatever the launch's rows (exact mode; ``exact_swiglu``, a dense SwiGLU's
gate/up product with its activation, is its variant). ``skinny_linear_fp8``: the skinny product of
float8 weights with per-output-channel scales (``skinny_linear``'s kernels, upcasting in registers)."""

from . import add_rmsnorm_gemv, exact_linear, skinny_linear, skinny_linear_fp8  # noqa: F401  (registers the ops)
