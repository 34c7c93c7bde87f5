"""``x @ W^T`` on 1-16 rows, streaming the weights once: ``skinny_linear`` (and its SwiGLU, pair and
add + norm epilogue variants, one kernel) and ``add_rmsnorm_gemv`` (one row with the residual add and
RMSNorm as its prologue). ops/routing.py says which rows take them. ``exact_linear``: every row with
the same arithmetic whatever the launch's rows (exact mode; ``exact_swiglu``, a dense SwiGLU's
gate/up product with its activation, is its variant)."""

from . import add_rmsnorm_gemv, exact_linear, skinny_linear  # noqa: F401  (registers the ops)
