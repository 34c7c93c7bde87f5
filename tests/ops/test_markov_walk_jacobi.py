"""The Jacobi (fixed-point) greedy Markov walk, ops/markov_walk/jacobi.py, against the plain
sequential loop (``markov_greedy_walk_reference``) for the tokens, and against a plain fixed-point
loop written here (``_jacobi_reference``) for the number of passes it needs.

Inputs are test_markov_walk.py's order-independent ones (exact whatever the summation order), so
tokens compare exactly. Their biases are as large as the base logits, so most walks need many
passes; scaling ``w2`` down makes one pass enough; :func:`test_one_flip_needs_two_passes` builds a
walk in which the bias moves exactly one slot's argmax.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.markov_walk.op import markov_greedy_walk_reference
from lfmspark.ops.markov_walk.jacobi import jacobi_pass_counts, markov_greedy_walk_jacobi
from lfmspark.ops.routing import WALK_LANES
from lfmspark.ops.markov_walk.persistent import PersistentWalkConfig

from test_markov_walk import _grid_inputs

CONFIGS = [PersistentWalkConfig(block_v=32, resident=0, num_warps=4),
           PersistentWalkConfig(block_v=64, resident=1, num_warps=4),
           PersistentWalkConfig(block_v=32, resident=2, num_warps=4),
           PersistentWalkConfig(block_v=32, resident=1, num_warps=4, programs=3)]


def _jacobi_reference(base, anchor, w1, w2) -> tuple[torch.Tensor, int]:
    """The fixed-point iteration op for op: guesses from the base logits, then biased passes until
    every slot's previous token is what the last pass produced (over all rows), at most ``G``."""
    G = base.shape[1]
    x = base.float().argmax(dim=-1)
    prev = torch.cat([anchor[:, None], x[:, :-1]], dim=1)
    passes = 0
    while True:
        passes += 1
        x = (base.float() + F.linear(F.embedding(prev, w1), w2).float()).argmax(dim=-1)
        new_prev = torch.cat([anchor[:, None], x[:, :-1]], dim=1)
        if torch.equal(new_prev, prev) or passes >= G:
            return x, passes
        prev = new_prev


def _run(base, anchor, w1, w2, config: PersistentWalkConfig | None) -> tuple[torch.Tensor, int]:
    before = jacobi_pass_counts()
    out = markov_greedy_walk_jacobi(base, anchor, w1, w2, config, count_passes=True)
    passes, walks = (a - b for a, b in zip(jacobi_pass_counts(), before))
    assert walks == 1
    return out, passes


def _check(base, anchor, w1, w2, config: PersistentWalkConfig | None = None) -> int:
    """Tokens equal the sequential walk's, passes the fixed-point loop's (whose guesses are the base
    argmax, as pass 0's are); returns the passes."""
    cpu = [t.cpu() for t in (base, anchor, w1, w2)]
    out, passes = _run(base, anchor, w1, w2, config)
    assert out.dtype == torch.int64 and out.shape == base.shape[:2]
    assert torch.equal(out.cpu(), markov_greedy_walk_reference(*cpu)), (config, out)
    ref_tokens, ref_passes = _jacobi_reference(*cpu)
    assert torch.equal(ref_tokens, markov_greedy_walk_reference(*cpu))   # the loop above is exact too
    assert passes == ref_passes, (config, passes, ref_passes)
    return passes


@pytest.mark.parametrize("config", CONFIGS, ids=["stream", "res1", "res2", "p3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B, G, V, r", [(1, 9, 500, 48), (2, 8, 97, 16), (1, 16, 320, 64), (1, 1, 200, 16)])
def test_matches_the_sequential_walk(triton_device: str, config: PersistentWalkConfig, dtype: torch.dtype,
                                     B: int, G: int, V: int, r: int) -> None:
    """Large biases (many passes), one to sixteen lanes, two rows in one launch, V not a multiple of
    the block, a rank not a power of two, resident blocks 0-2, several programs."""
    passes = _check(*_grid_inputs(triton_device, dtype, B, G, V, r, seed=B * 31 + G + r), config)
    assert G == 1 or passes > 2        # these inputs do exercise the correction passes


@pytest.mark.parametrize("config", CONFIGS[:2], ids=["stream", "res1"])
def test_small_bias_needs_one_pass(triton_device: str, config: PersistentWalkConfig) -> None:
    """A bias far below the gaps of the base logits moves no slot: one biased pass."""
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.float32, 1, 9, 500, 48, seed=3)
    base = base + torch.arange(500, device=base.device) * 1e-3      # distinct logits, gaps ~1e-3 or more
    w2 = w2 / 2 ** 20                                               # |bias| <= 48 * 2 * 2 / 2**20 < 2e-4
    assert _check(base, anchor, w1, w2, config) == 1


def test_one_flip_needs_two_passes(triton_device: str) -> None:
    """Base logits whose argmax the bias moves at one slot only (slot 3, under the true previous
    token): the guess of slot 4's previous token is wrong, the second pass fixes it and confirms."""
    G, V, r = 9, 64, 16
    w1 = torch.zeros(V, r)
    w2 = torch.zeros(V, r)
    w1[7, 0] = 1.0                                   # only previous token 7 has a bias:
    w2[40, 0] = 2.0                                  # +2 at column 40
    base = torch.zeros(1, G, V)
    for k, t in enumerate([5, 6, 7, 9, 11, 12, 13, 14, 15]):
        base[0, k, t] = 3.0                          # base argmax per slot
    base[0, 3, 40] = 1.5                             # slot 3 (after 7): 1.5 + 2 beats 3.0 -> 40
    anchor = torch.tensor([1])
    args = [t.to(triton_device) for t in (base, anchor, w1, w2)]
    assert markov_greedy_walk_reference(base, anchor, w1, w2).tolist() == [[5, 6, 7, 40, 11, 12, 13, 14, 15]]
    assert _check(*args, CONFIGS[1]) == 2


def test_worst_case_takes_g_passes(triton_device: str) -> None:
    """Every slot's token is decided by its previous token (base flat, a bias that maps each token
    to its successor), so each pass fixes one more slot: G passes, still exact."""
    G, V = 6, 32
    w1 = torch.eye(V)
    w2 = torch.roll(torch.eye(V), 1, dims=0)         # bias(prev)[v] = 1 where v == prev + 1
    base = torch.zeros(1, G, V)
    anchor = torch.tensor([3])
    args = [t.to(triton_device) for t in (base, anchor, w1, w2)]
    assert markov_greedy_walk_reference(base, anchor, w1, w2).tolist() == [[4, 5, 6, 7, 8, 9]]
    assert _check(*args, PersistentWalkConfig(block_v=16, resident=1, num_warps=4)) == G


def test_ties_and_nan(triton_device: str) -> None:
    """First index among equal maxima (guesses included) and NaN winning, as ``torch.argmax``."""
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.float32, 1, 5, 300, 16, seed=7)
    base[0, 1, 200] = float("nan")
    base[0, 3] = 1.0                                  # flat: the bias alone decides, ties to the first
    for config in CONFIGS:
        _check(base, anchor, w1, w2, config)


def test_passes_are_counted_only_when_asked(triton_device: str) -> None:
    """Without ``count_passes`` the kernel leaves the tally alone (the production walk)."""
    args = _grid_inputs(triton_device, torch.bfloat16, 1, 9, 300, 16, seed=16)
    before = jacobi_pass_counts()
    out = markov_greedy_walk_jacobi(*args, CONFIGS[1])
    assert jacobi_pass_counts() == before
    assert torch.equal(out.cpu(), markov_greedy_walk_reference(*(t.cpu() for t in args)))


def test_op_counts_passes_when_asked(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lfmspark::markov_greedy_walk(..., count_passes=True)`` at one row (the Jacobi walk) tallies one walk."""
    if triton_device == "cpu":
        from env_vars import interpret_triton

        interpret_triton(monkeypatch)
    args = _grid_inputs(triton_device, torch.bfloat16, 1, 9, 300, 16, seed=16)
    before = jacobi_pass_counts()
    out = torch.ops.lfmspark.markov_greedy_walk(*args, "jacobi", True)
    assert jacobi_pass_counts()[1] - before[1] == 1
    assert torch.equal(out.cpu(), markov_greedy_walk_reference(*(t.cpu() for t in args)))


def test_rejects_what_it_cannot_run(triton_device: str) -> None:
    with pytest.raises(ValueError, match=f"1-{WALK_LANES} .* got 2 x 9 lanes"):
        markov_greedy_walk_jacobi(*_grid_inputs(triton_device, torch.bfloat16, 2, 9, 100, 16, seed=1))
    with pytest.raises(ValueError, match="rank 320"):
        markov_greedy_walk_jacobi(*_grid_inputs(triton_device, torch.bfloat16, 1, 2, 100, 320, seed=2))
    with pytest.raises(ValueError, match="resident = 3"):
        markov_greedy_walk_jacobi(*_grid_inputs(triton_device, torch.bfloat16, 1, 2, 100, 16, seed=2),
                                  PersistentWalkConfig(resident=3))


# ---------------------------------------------------------------------------------------------
# CUDA: the served shape (V = 65536, r = 256, G = 9, bf16), a real grid, graph replay

GPU_CONFIGS = [PersistentWalkConfig(block_v=bv, resident=r, num_warps=w)
               for bv, r, w in [(128, 0, 8), (256, 1, 8), (128, 2, 16)]]


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_CONFIGS)), ids=["bv128r0", "bv256r1", "bv128r2"])
@pytest.mark.parametrize("small", [False, True], ids=["large_bias", "small_bias"])
def test_gpu_served_shape(index: int, small: bool) -> None:
    """One program per SM, a real barrier per pass; large biases (many passes) and, with distinct base
    logits (gaps of 2**-17, exact in fp32) and biases below 2**-20, one pass."""
    base, anchor, w1, w2 = _grid_inputs("cuda", torch.bfloat16, 1, 9, 65536, 256, seed=40 + index)
    if small:
        base = base + torch.arange(65536, device="cuda") * 2 ** -17
        w2 = w2 * 2 ** -30                    # |bias| <= 256 * 2 * 2 * 2**-30 = 2**-20
    passes = _check(base, anchor, w1, w2, GPU_CONFIGS[index])
    assert passes == 1 if small else passes > 2


@pytest.mark.gpu
def test_gpu_graph_replay_follows_input_and_counts_passes() -> None:
    """The default walk of one row inside a CUDA graph after a large product (PDL edges in and out),
    replayed with new inputs: tokens follow them, the pass tally grows by each replay's passes, and
    the barrier counter ends at rest."""
    from lfmspark.ops.markov_walk.persistent import counters_for
    base, anchor, w1, w2 = _grid_inputs("cuda", torch.bfloat16, 1, 9, 65536, 256, seed=1)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2, "jacobi", True), x @ m

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = step()
    for seed in range(4):
        new = _grid_inputs("cuda", torch.bfloat16, 1, 9, 65536, 256, seed=100 + seed)
        base.copy_(new[0])
        anchor.copy_(new[1])
        if seed % 2:
            w2.copy_(new[3] * 2 ** -30)
        before = jacobi_pass_counts()
        graph.replay()
        passes, walks = (a - b for a, b in zip(jacobi_pass_counts(), before))
        cpu = (base.cpu(), anchor.cpu(), w1.cpu(), w2.cpu())
        assert torch.equal(out.cpu(), markov_greedy_walk_reference(*cpu))
        assert (passes, walks) == (_jacobi_reference(*cpu)[1], 1)
    assert counters_for(w2)[0].item() in (0, -2 ** 31)
