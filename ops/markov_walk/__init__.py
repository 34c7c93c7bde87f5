"""The DSpark draft's greedy Markov walk (``lfmspark::markov_greedy_walk``): one launch per slot
(op.py), the sequential walk in one persistent launch (persistent.py), or a fixed-point iteration
over the slots in one launch (jacobi.py). ops/routing.py ``walk_kernel`` picks one."""

from . import op  # noqa: F401  (registers the op)
