"""``lfmspark::markov_greedy_walk``: the fused greedy Markov walk on the Triton kernels (interpreter
on CPU, native on CUDA) against the plain loop (``markov_greedy_walk_reference``).

Exact comparisons need inputs whose bias does not depend on the summation order: the kernel sums
``e . w2[v]`` in another order than ``F.linear`` (tl.dot tiles vs oneDNN / cuBLAS), so with
arbitrary weights the fp32 sums, and after one rounding the bf16 biases, may differ by an ulp and a
near-tie could flip a token. So the exact tests draw weights from multiples of 1/8 in [-2, 2]
(exact in bf16 and fp16): every product and partial sum is a multiple of 1/64 below 2**12, exact
in fp32 whatever the order, and both sides round the same fp32 value to the weight dtype (round to
nearest even; biases of about 10 need that rounding). The base logits are multiples of 1/4, so
equal maxima are frequent and the first-index tie-break is exercised too;
:func:`test_flat_logits_expose_any_bias_difference` makes every logit a tie unless the kernel's
bias differs from the reference's in any column. Random continuous weights
(:func:`test_random_weights_pick_a_near_argmax`) are compared with a margin instead: where the
reference's top-2 margin exceeds a few ulps of the bias, tokens must be equal; elsewhere the
kernel's pick must be within that tolerance of the maximum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.markov_walk import op as walk_op
from lfmspark.ops.markov_walk import persistent as walk_persistent
from lfmspark.ops.markov_walk.op import WalkConfig, markov_greedy_walk_reference, markov_greedy_walk_triton, walk_config
from lfmspark.ops.markov_walk.persistent import (PersistentWalkConfig, _grid_barrier, markov_greedy_walk_persistent,
                                                 programs_for)
from lfmspark.ops.routing import walk_kernel
from lfmspark.ops.weight_rounding import round_to_weight_dtype
from env_vars import interpret_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL = WalkConfig(block_v=64, block_r=16, num_warps=4)   # many column blocks at test sizes


def _grid_inputs(device: str, dtype: torch.dtype, B: int, G: int, V: int, r: int, seed: int):
    """Order-independent inputs (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randint(-16, 17, (V, r), generator=g) / 8).to(device, dtype)
    w2 = (torch.randint(-16, 17, (V, r), generator=g) / 8).to(device, dtype)
    base = (torch.randint(-40, 41, (B, G, V), generator=g) / 4).to(device)
    anchor = torch.randint(0, V, (B,), generator=g).to(device)
    return base, anchor, w1, w2


def _same(base, anchor, w1, w2, config: WalkConfig | None = None, walk: str = "jacobi") -> torch.Tensor:
    out = markov_greedy_walk_triton(base, anchor, w1, w2, walk, config)
    ref = markov_greedy_walk_reference(base.cpu(), anchor.cpu(), w1.cpu(), w2.cpu())
    assert out.dtype == torch.int64 and out.shape == base.shape[:2] and out.device == base.device
    assert torch.equal(out.cpu(), ref), (out, ref)
    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B, G", [(1, 9), (3, 9), (3, 1)])
@pytest.mark.parametrize("V, r", [(500, 48), (320, 64), (97, 16)], ids=["v500_r48", "v320_r64", "v97_r16"])
def test_matches_reference_exactly(triton_device: str, dtype: torch.dtype, B: int, G: int, V: int, r: int) -> None:
    """V not a multiple of the block (500, 97), ranks that are (64, 16) and are not (48) a
    multiple of the rank step; the default launch and a many-block one."""
    base, anchor, w1, w2 = _grid_inputs(triton_device, dtype, B, G, V, r, seed=B * 100 + G * 10 + r)
    ref = _same(base, anchor, w1, w2, SMALL)
    _same(base, anchor, w1, w2)
    if G > 1:
        assert len(set(ref[0].tolist())) > 1          # the walk moves (not one repeated token)


def test_more_rows_than_a_row_block(triton_device: str) -> None:
    """More than 16 rows take 32-row blocks: one block for B = 20, two for B = 40."""
    for B in (20, 40):
        _same(*_grid_inputs(triton_device, torch.bfloat16, B, 3, 200, 16, seed=B), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_flat_logits_expose_any_bias_difference(triton_device: str, dtype: torch.dtype) -> None:
    """Base logits built as ``c - bias`` from the reference's own (rounded) bias along a chosen
    walk, so that every logit from the chosen token ``t_k`` on equals ``c`` exactly (those before
    it are ``c - 1``): the walk must return ``t_k``, and any column whose bias the kernel rounds
    differently (rounding mode, summation) would exceed ``c`` or break the tie."""
    B, G, V, r = 2, 9, 500, 48
    _, anchor, w1, w2 = _grid_inputs("cpu", dtype, B, G, V, r, seed=5)
    chosen = torch.randint(0, V, (B, G), generator=torch.Generator().manual_seed(6))
    base = torch.empty(B, G, V)
    prev = anchor
    for k in range(G):
        bias = F.linear(F.embedding(prev, w1), w2).float()
        before = torch.arange(V)[None, :] < chosen[:, k:k + 1]
        base[:, k] = 20.0 - before.float() - bias        # exact in fp32: multiples of 1/64 below 2**8
        prev = chosen[:, k]
    assert torch.equal(markov_greedy_walk_reference(base, anchor, w1, w2), chosen)
    args = (base.to(triton_device), anchor.to(triton_device), w1.to(triton_device), w2.to(triton_device))
    assert torch.equal(markov_greedy_walk_triton(*args, config=SMALL).cpu(), chosen)
    assert torch.equal(markov_greedy_walk_triton(*args).cpu(), chosen)


def test_ties_take_the_first_index(triton_device: str) -> None:
    """Equal maxima across and within column blocks (64 wide), and ``-inf`` logits."""
    B, G, V, r = 2, 4, 300, 16
    w1 = torch.zeros(V, r)
    w2 = torch.zeros(V, r)
    w1[:, 0] = 1.0
    w2[250, 0] = 0.5                                 # bias +0.5 at column 250 for every prev
    base = torch.full((B, G, V), -3.0)
    base[0, 0, [70, 10, 200]] = 1.0                  # across blocks: 10
    base[1, 0, [130, 129, 180]] = 1.0                # within a block, then another: 129
    base[0, 1, [5, 250]] = torch.tensor([1.5, 1.0])  # 1.0 + 0.5 bias ties 1.5: 5
    base[1, 1, 250] = 1.0                            # the bias decides: 250
    base[:, 2] = -float("inf")
    base[0, 2, 299] = -1e30                          # the only finite logit (after a zero bias)
    base[1, 2, 250] = -float("inf")                  # all -inf (the bias leaves -inf): 0
    base[:, 3, 33] = 7.0
    base[:, 3, 97] = 7.0                             # across blocks again: 33
    for dtype in (torch.float32, torch.bfloat16):
        args = (base.to(triton_device), torch.tensor([3, 4], device=triton_device),
                w1.to(triton_device, dtype), w2.to(triton_device, dtype))
        ref = _same(*args, SMALL)
        assert ref.tolist() == [[10, 5, 299, 33], [129, 250, 0, 33]]
        _same(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_base(triton_device: str, dtype: torch.dtype) -> None:
    """A bf16 / fp16 ``base`` (the LM head's output, before ``.float()``) gives the tokens of its
    fp32 copy (multiples of 1/4 below 16: exact in both)."""
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.bfloat16, 3, 9, 300, 16, seed=12)
    ref = _same(base.to(dtype), anchor, w1, w2, SMALL)
    assert torch.equal(ref, markov_greedy_walk_reference(base.cpu(), anchor.cpu(), w1.cpu(), w2.cpu()))


def test_nan_logits_win(triton_device: str) -> None:
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.float32, 2, 3, 300, 16, seed=7)
    base[0, 1, 200] = float("nan")
    base[1, 0, 150] = base[1, 0, 20] = float("nan")
    ref = _same(base, anchor, w1, w2, SMALL)
    assert ref[0, 1] == 200 and ref[1, 0] == 20


def test_strided_base_and_empty(triton_device: str) -> None:
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.bfloat16, 3, 9, 200, 16, seed=8)
    wide = torch.zeros(3, 12, 260, device=triton_device)
    wide[:, 1:10, 30:230] = base
    _same(wide[:, 1:10, 30:230], anchor, w1, w2, SMALL)       # row and slot strides of a wider tensor
    assert markov_greedy_walk_triton(base[:0], anchor[:0], w1, w2).shape == (0, 9)
    assert markov_greedy_walk_triton(base[:, :0], anchor, w1, w2).shape == (3, 0)


def test_random_weights_pick_a_near_argmax(triton_device: str) -> None:
    """Continuous bf16 weights at the draft's scale: replaying the kernel's own walk, each token is
    the reference argmax wherever the reference's top-2 margin exceeds ``tol`` (a few bf16 ulps of
    the largest bias, which bounds the rounding differences), and within ``tol`` of the maximum
    elsewhere."""
    B, G, V, r = 3, 9, 1000, 64
    g = torch.Generator().manual_seed(11)
    w1 = (torch.randn(V, r, generator=g) * 0.5).bfloat16()
    w2 = (torch.randn(V, r, generator=g) * 0.5).bfloat16()
    base = torch.randn(B, G, V, generator=g) * 2
    anchor = torch.randint(0, V, (B,), generator=g)
    out = markov_greedy_walk_triton(base.to(triton_device), anchor.to(triton_device), w1.to(triton_device),
                                    w2.to(triton_device)).cpu()
    prev, decisive = anchor, 0
    for k in range(G):
        bias = F.linear(F.embedding(prev, w1), w2).float()
        logits = base[:, k] + bias
        tol = 4 * 2.0 ** -8 * bias.abs().max().item()
        top2 = logits.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        picked = logits.gather(1, out[:, k:k + 1])[:, 0]
        assert (picked >= top2[:, 0] - tol).all()
        sure = margin > tol
        assert torch.equal(out[sure, k], logits.argmax(-1)[sure])
        decisive += int(sure.sum())
        prev = out[:, k]
    assert decisive >= B * G * 3 // 4                # the margin check decided most tokens


@triton.jit
def _round_kernel(x_ptr, out_ptr, N, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(out_ptr + offs, round_to_weight_dtype(tl.load(x_ptr + offs, mask=ok), ROUND), mask=ok)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the interpreter's fp16 inf
@pytest.mark.parametrize("dtype, mode", [(torch.bfloat16, 1), (torch.float16, 2)], ids=["bf16", "fp16"])
def test_rounding_to_the_weight_dtype(triton_device: str, dtype: torch.dtype, mode: int) -> None:
    """The kernel's fp32 -> weight dtype -> fp32 rounding equals torch's ``.to(dtype).float()``
    (round to nearest even), on random values, exact halfway cases, specials and overflow."""
    g = torch.Generator().manual_seed(12)
    x = torch.cat([torch.randn(2000, generator=g) * 10 ** torch.randint(-3, 4, (2000,), generator=g),
                   torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3.4e38, -3.4e38, 7e4])])
    bits = torch.randint(0, 2 ** 23, (1000,), generator=g, dtype=torch.int32) | 0x3F800000  # [1, 2)
    bits[:500] = (bits[:500] & ~0xFFFF) | 0x8000          # exact bf16 halfway points, both parities
    bits[500:700] = (bits[500:700] & ~0x1FFF) | 0x1000    # exact fp16 halfway points
    x = torch.cat([x, bits.view(torch.float32), -bits.view(torch.float32)]).to(triton_device)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), ROUND=mode, BLOCK=256)
    torch.testing.assert_close(out, x.to(dtype).float(), rtol=0, atol=0, equal_nan=True)


def test_rejects_bad_inputs(triton_device: str) -> None:
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.bfloat16, 2, 3, 100, 16, seed=9)
    for args, match in [((base.double(), anchor, w1, w2), "fp32"), ((base, anchor.int(), w1, w2), "int64"),
                        ((base, anchor, w1.float(), w2), "share"), ((base, anchor, w1, w2[:50]), "mismatch"),
                        ((base, anchor[:1], w1, w2), "mismatch"), ((base[0], anchor, w1, w2), "expected")]:
        with pytest.raises(ValueError, match=match):
            markov_greedy_walk_triton(*args)
        with pytest.raises(ValueError, match=match):
            torch.ops.lfmspark.markov_greedy_walk(*(a.cpu() for a in args))   # the reference path too


def test_default_config() -> None:
    assert walk_config(1, 65536, 256) == WalkConfig(block_v=256, block_r=64, num_warps=8)
    assert walk_config(3, 100, 8) == WalkConfig(block_v=128, block_r=16, num_warps=8)


# ---------------------------------------------------------------------------------------------
# the persistent walk (one launch, a grid barrier per slot; one program in the interpreter)

PERSISTENT = [PersistentWalkConfig(block_v=32, resident=0, num_warps=4),
              PersistentWalkConfig(block_v=64, resident=1, num_warps=4),
              PersistentWalkConfig(block_v=32, resident=2, num_warps=4),
              PersistentWalkConfig(block_v=32, resident=1, num_warps=4, programs=3)]


def _same_persistent(base, anchor, w1, w2, config: PersistentWalkConfig) -> None:
    out = markov_greedy_walk_persistent(base, anchor, w1, w2, config)
    ref = markov_greedy_walk_reference(base.cpu(), anchor.cpu(), w1.cpu(), w2.cpu())
    assert out.dtype == torch.int64 and out.shape == base.shape[:2]
    assert torch.equal(out.cpu(), ref), (config, out, ref)


@pytest.mark.parametrize("config", PERSISTENT, ids=["stream", "res1", "res2", "p3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B, G, V, r", [(1, 9, 500, 48), (16, 3, 97, 16), (5, 9, 320, 64)])
def test_persistent_matches_reference(triton_device: str, config: PersistentWalkConfig, dtype: torch.dtype,
                                      B: int, G: int, V: int, r: int) -> None:
    """Resident blocks (0-2), several blocks per program, V not a multiple of the block, rank not a
    power of two, 1-16 rows."""
    _same_persistent(*_grid_inputs(triton_device, dtype, B, G, V, r, seed=B * 7 + r), config)


def test_persistent_ties_nan_and_flat_logits(triton_device: str) -> None:
    """The step kernels' edge cases through the persistent walk: first index among equal maxima
    across blocks and programs, NaN wins, a half-precision base with a strided slot."""
    base, anchor, w1, w2 = _grid_inputs(triton_device, torch.float32, 2, 3, 300, 16, seed=7)
    base[0, 1, 200] = float("nan")
    base[1, 0, 150] = base[1, 0, 20] = float("nan")
    base[0, 2] = 1.0                                   # flat: the bias alone decides, ties to the first
    for config in PERSISTENT:
        _same_persistent(base, anchor, w1, w2, config)
    wide = torch.zeros(2, 5, 300, device=triton_device, dtype=torch.bfloat16)
    wide[:, 1:4] = base.bfloat16()
    _same_persistent(wide[:, 1:4], anchor, w1, w2, PERSISTENT[1])


def test_walk_choice_picks_the_kernel(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a config: ``jacobi`` (the default) takes the Jacobi walk where rows x slots fit 16
    lanes and otherwise what ``persistent`` takes: the persistent walk for 2-16 rows, the step
    kernels for one row and beyond 16; ``steps`` and any step config take the step kernels. The
    tokens are the reference's whichever runs."""
    calls = []
    for name in ("markov_greedy_walk_persistent", "markov_greedy_walk_jacobi"):
        real = getattr(walk_op, name)
        monkeypatch.setattr(walk_op, name, lambda *a, _real=real, _name=name, **k:
                            calls.append((_name.rsplit("_", 1)[1], a[0].shape[0])) or _real(*a, **k))
    for B, G, walk, config, expected in [(1, 9, "jacobi", None, "jacobi"), (2, 8, "jacobi", None, "jacobi"),
                                         (2, 9, "jacobi", None, "persistent"), (16, 3, "jacobi", None, "persistent"),
                                         (17, 3, "jacobi", None, None), (1, 9, "persistent", None, None),
                                         (2, 3, "persistent", None, "persistent"), (3, 3, "steps", None, None),
                                         (1, 3, "jacobi", SMALL, None), (3, 3, "persistent", SMALL, None)]:
        calls.clear()
        _same(*_grid_inputs(triton_device, torch.bfloat16, B, G, 200, 16, seed=B + G), config, walk)
        assert calls == ([(expected, B)] if expected else []), (B, G, walk, config)
    with pytest.raises(ValueError, match="markov_walk='grid': use one of jacobi, persistent, steps"):
        markov_greedy_walk_triton(*_grid_inputs(triton_device, torch.bfloat16, 2, 3, 200, 16, seed=1), "grid")


def test_walk_kernel_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops/routing.py ``walk_kernel`` on CUDA: the Jacobi walk for up to 16 lanes, the persistent one
    for 2-16 rows, the step kernels for one row under ``persistent``, beyond 16 rows, for a rank
    that does not fit one program's shared memory, and under an MPS thread limit (fewer SMs than
    the device reports: a grid barrier could wait forever)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    assert walk_kernel("jacobi", cuda, 1, 9, 256) == "jacobi" and walk_kernel("jacobi", cuda, 2, 9, 256) == "persistent"
    assert walk_kernel("persistent", cuda, 2, 9, 256) == "persistent" == walk_kernel("persistent", cuda, 16, 9, 48)
    assert walk_kernel("persistent", cuda, 1, 9, 256) == "steps" == walk_kernel("persistent", cuda, 17, 9, 256)
    assert walk_kernel("jacobi", cuda, 1, 9, 320) == "steps" == walk_kernel("persistent", cuda, 4, 9, 320)
    assert walk_kernel("steps", cuda, 1, 9, 256) == "steps"
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert walk_kernel("jacobi", cuda, 1, 9, 256) == "steps" == walk_kernel("persistent", cuda, 4, 9, 256)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    assert walk_kernel("persistent", cuda, 4, 9, 256) == "persistent"


def test_persistent_rejects_what_it_cannot_run(triton_device: str) -> None:
    """More than 16 rows or a rank above 256: a clear error instead of garbage rows or a launch that
    cannot fit (the op's launcher takes the step kernels there)."""
    with pytest.raises(ValueError, match="1-16 rows and a rank up to 256, got 18 rows"):
        markov_greedy_walk_persistent(*_grid_inputs(triton_device, torch.bfloat16, 18, 2, 100, 16, seed=1))
    args = _grid_inputs(triton_device, torch.bfloat16, 2, 2, 100, 320, seed=2)
    with pytest.raises(ValueError, match="rank 320"):
        markov_greedy_walk_persistent(*args)
    _same(*args)                                     # the op itself runs it on the step kernels


def test_barrier_counter_is_never_first_made_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter created inside a CUDA-graph capture would hold garbage until that graph's first
    replay, so the first walk over a weight must run outside a capture."""
    w2 = torch.zeros(8, 4)
    # counters are kept per weight address: an earlier test's freed weight may have had this one's
    monkeypatch.setattr(walk_persistent, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run it once before capturing"):
        walk_persistent.counters_for(w2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    sync, stats = walk_persistent.counters_for(w2)
    assert sync.tolist() == [0] and stats.tolist() == [0, 0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert walk_persistent.counters_for(w2)[0] is sync    # existing counters are fine inside a capture


def test_programs_for_the_served_vocabulary() -> None:
    """At most one program per SM, each with whole blocks, covering the vocabulary."""
    cpu = torch.device("cpu")
    assert programs_for(65536, 128, cpu, 132) == (128, 4)
    assert programs_for(65536, 64, cpu, 132) == (128, 8)
    assert programs_for(65536, 128, cpu, 1) == (1, 512)
    assert programs_for(300, 64, cpu, 132) == (5, 1)
    for V, bv, limit in [(500, 32, 3), (151936, 128, 132), (97, 64, 8)]:
        P, n = programs_for(V, bv, cpu, limit)
        assert P <= limit and P * n * bv >= V and (P - 1) * n * bv < V


def test_resident_block_only_while_one_block_streams() -> None:
    """Both served vocabularies on an H100's 132 SMs at the default 256-column blocks: 65,536 tokens
    give two blocks a program (one kept on chip), 128,000 give four, which stream with none kept (a
    resident block beside the pipelined stream needs more shared memory than an sm_90 has)."""
    cpu = torch.device("cpu")
    assert programs_for(65536, 256, cpu, 132) == (128, 2)
    assert walk_persistent.resident_blocks(2, 1) == 1
    assert programs_for(128000, 256, cpu, 132) == (125, 4)
    assert walk_persistent.resident_blocks(4, 1) == 0
    assert walk_persistent.resident_blocks(1, 2) == 1
    assert walk_persistent.resident_blocks(3, 2) == 2


def test_persistent_rejects_bad_resident() -> None:
    with pytest.raises(ValueError, match="resident = 3"):
        markov_greedy_walk_persistent(*_op_args(), PersistentWalkConfig(resident=3))


# ---------------------------------------------------------------------------------------------
# op registration, dispatch, torch.compile

def _op_args():
    return _grid_inputs("cpu", torch.bfloat16, 2, 3, 150, 16, seed=10)


def test_cpu_dispatch_is_the_reference() -> None:
    args = _op_args()
    assert torch.equal(torch.ops.lfmspark.markov_greedy_walk(*args), markov_greedy_walk_reference(*args))


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.markov_greedy_walk, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.markov_greedy_walk, _op_args())


@pytest.mark.parametrize("triton_on_cpu", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("walk", ["persistent", "steps"])
def test_opcheck_with_a_walk_choice(monkeypatch: pytest.MonkeyPatch, triton_on_cpu: bool, walk: str) -> None:
    """The op with its kernel choice and the pass tally (read by the Jacobi walk only)."""
    if triton_on_cpu:
        interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.markov_greedy_walk, (*_op_args(), walk, True))


def test_op_refuses_an_unknown_walk() -> None:
    with pytest.raises(ValueError, match="markov_walk='fast'"):
        torch.ops.lfmspark.markov_greedy_walk(*_op_args(), "fast")


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    base, anchor, w1, w2 = _op_args()

    def walk(base, anchor, w1, w2):
        return torch.ops.lfmspark.markov_greedy_walk(base * 2, anchor, w1, w2) + 1

    torch._dynamo.reset()
    compiled = torch.compile(walk, fullgraph=True)
    assert torch.equal(compiled(base, anchor, w1, w2), markov_greedy_walk_reference(base * 2, anchor, w1, w2) + 1)


# ---------------------------------------------------------------------------------------------
# CUDA: the served shape (LFM2.5-1.2B: V = 65536, r = 256, G = 9, bf16), CUDA-graph replay

@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4, 20])
def test_gpu_served_shape(B: int) -> None:
    _same(*_grid_inputs("cuda", torch.bfloat16, B, 9, 65536, 256, seed=B))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4, 16])
def test_gpu_large_vocabulary(B: int) -> None:
    """LFM2.5-8B-A1B's 128,000-token vocabulary: four column blocks a persistent program, which once
    asked more shared memory than an sm_90 has (launch failure); the Jacobi walk at batch 1."""
    _same(*_grid_inputs("cuda", torch.bfloat16, B, 9, 128000, 256, seed=B + 7))


GPU_CONFIGS = [PersistentWalkConfig(block_v=bv, resident=r, num_warps=w)
               for bv, r, w in [(128, 0, 8), (256, 1, 8), (128, 2, 16), (64, 2, 8)]]


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_CONFIGS)), ids=["bv128r0", "bv256r1", "bv128r2", "bv64r2"])
@pytest.mark.parametrize("B", [1, 4, 16])
def test_gpu_persistent_served_shape(B: int, index: int) -> None:
    """One program per SM, each with its slice of ``w2``, a real grid barrier per slot (other inputs
    per config, so partials a previous walk left in reused scratch cannot pass for this one's)."""
    _same_persistent(*_grid_inputs("cuda", torch.bfloat16, B, 9, 65536, 256, seed=B * 10 + index), GPU_CONFIGS[index])


@triton.jit
def _barrier_stress_kernel(slots_ptr, sync_ptr, bad_ptr, delay_ptr, P, STEPS: tl.constexpr, BLOCK_P: tl.constexpr):
    # each step: a delay that grows with the program id (later programs arrive late), one slot written,
    # the barrier, then every program checks every slot of the step
    j = tl.program_id(0)
    sync_ptr = sync_ptr.to(tl.pointer_type(tl.uint32))
    offs = tl.arange(0, BLOCK_P)
    bad = 0
    for k in range(STEPS):
        spin = 0
        for _ in range(((j * 7 + k * 13) % P) * 4):
            spin += tl.load(delay_ptr, volatile=True)
        tl.store(slots_ptr + k * P + j, k * P + j + 1 + spin)
        _grid_barrier(sync_ptr, P, True)
        seen = tl.load(slots_ptr + k * P + offs, mask=offs < P, other=0, cache_modifier=".cg")
        bad += tl.sum(((seen != k * P + offs + 1) & (offs < P)).to(tl.int32))
    tl.store(bad_ptr + j, bad)


@pytest.mark.gpu
def test_gpu_grid_barrier_orders_every_program() -> None:
    """The barrier alone, one program per SM with skewed arrivals over 50 steps: after each barrier
    every program sees every program's write of that step, and the counter is back at rest."""
    P = torch.cuda.get_device_properties(0).multi_processor_count
    steps = 50
    slots = torch.zeros(steps * P, dtype=torch.int32, device="cuda")
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    bad = torch.full((P,), -1, dtype=torch.int32, device="cuda")
    delay = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        _barrier_stress_kernel[(P,)](slots, sync, bad, delay, P, STEPS=steps, BLOCK_P=triton.next_power_of_2(P),
                                     num_warps=4)
        torch.cuda.synchronize()
        assert bad.tolist() == [0] * P
        assert sync.item() in (0, -2 ** 31)


@pytest.mark.gpu
def test_gpu_steps_served_shape() -> None:
    _same(*_grid_inputs("cuda", torch.bfloat16, 4, 9, 65536, 256, seed=3), walk="steps")


@pytest.mark.gpu
def test_gpu_persistent_barrier_state_survives_many_replays() -> None:
    """Two walks over two weights in one graph after a large product (PDL edges into and out of the
    walk), replayed 200 times: tokens follow the inputs, and each barrier counter is back at 0 or
    2**31 (its rest states) after every replay."""
    base, anchor, w1, w2 = _grid_inputs("cuda", torch.bfloat16, 2, 9, 65536, 256, seed=1)
    w2b = w2.flip(0).contiguous()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)

    def both():
        y = x @ m
        return (torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2),
                torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2b), y)

    both()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a, out_b, _ = both()
    syncs = [walk_persistent.counters_for(w)[0] for w in (w2, w2b)]
    for rep in range(200):
        if rep % 50 == 0:
            new = _grid_inputs("cuda", torch.bfloat16, 2, 9, 65536, 256, seed=100 + rep)
            base.copy_(new[0])
            anchor.copy_(new[1])
        graph.replay()
        if rep % 50 == 0:
            args = (base.cpu(), anchor.cpu(), w1.cpu())
            assert torch.equal(out_a.cpu(), markov_greedy_walk_reference(*args, w2.cpu()))
            assert torch.equal(out_b.cpu(), markov_greedy_walk_reference(*args, w2b.cpu()))
    torch.cuda.synchronize()
    for sync in syncs:
        assert sync.item() in (0, -2 ** 31)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_input() -> None:
    base, anchor, w1, w2 = _grid_inputs("cuda", torch.bfloat16, 2, 9, 65536, 256, seed=1)
    torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2)
    for seed in range(3):
        new = _grid_inputs("cuda", torch.bfloat16, 2, 9, 65536, 256, seed=100 + seed)
        base.copy_(new[0])
        anchor.copy_(new[1])
        graph.replay()
        assert torch.equal(out.cpu(), markov_greedy_walk_reference(base.cpu(), anchor.cpu(), w1.cpu(), w2.cpu()))
