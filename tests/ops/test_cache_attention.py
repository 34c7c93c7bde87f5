"""``lfmspark::cache_attention``: Triton kernel (interpreter on CPU, native on CUDA) against the
plain-PyTorch reference, the split merge in the attention kernel against the combine kernel
(``LFMSPARK_ATTENTION_COMBINE``), op registration checks, torch.compile and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
import lfmspark.ops.cache_attention as ca
from lfmspark.ops.cache_attention import (_merge_counters, attention_combine, cache_attention_reference,
                                          cache_attention_triton, plan_launch)

LAYERS, SLOTS = 2, 4
LAYER = 1  # the last layer, so a wrong layer offset reads other random values


def _inputs(device: str, dtype: torch.dtype, B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int,
            starts: list[int], slots: list[int], seed: int = 0):
    """Random q and a cache filled with random values everywhere (reads of wrong positions,
    slots, layers or heads change the result)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, n_heads, hd, generator=g).to(device, dtype)
    k_cache = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(device, dtype)
    start = torch.tensor(starts, dtype=torch.int64, device=device)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    return q, k_cache, v_cache, slot_t, start


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _check(device: str, dtype: torch.dtype, B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int,
           starts: list[int], slots: list[int], causal: bool, num_splits: int | None, seed: int = 0) -> None:
    q, k_cache, v_cache, slot_t, start = _inputs(device, dtype, B, T, n_heads, n_kv, hd, S, starts, slots, seed)
    scale = hd ** -0.5
    out = cache_attention_triton(q, k_cache, v_cache, LAYER, slot_t, start, causal, scale, num_splits=num_splits)
    ref = cache_attention_reference(q, k_cache, v_cache, LAYER, slot_t, start, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **_tol(dtype))
    pad = slot_t < 0
    if pad.any():
        assert (out[pad] == 0).all(), "padding rows must be exactly zero"


# ---------------------------------------------------------------------------------------------
# parity at tiny shapes: the interpreter on CPU (CI), native on CUDA

# (B, T, n_heads, n_kv, hd, S, starts, slots)
_SHAPES = {
    # decode, group 4; row 1's query is the cache's last position
    "decode_g4": (2, 1, 8, 2, 64, 64, [5, 63], [2, 0]),
    # verify-sized block, group 1, a padding row in the middle
    "t3_g1_pad": (3, 3, 2, 2, 16, 40, [0, 7, 30], [1, -1, 3]),
    # odd head count (6 heads over 2 kv heads); row 1's window runs past the cache end
    "t10_odd_heads_clip": (2, 10, 6, 2, 16, 200, [12, 195], [3, 1]),
    # prefill-like: 33 tokens x group 4 = 132 rows -> two row tiles; several 64-key blocks
    "t33_prefill": (1, 33, 4, 1, 16, 160, [100], [2]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", list(_SHAPES))
@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto", "nosplit"])
def test_parity_fp32(triton_device: str, name: str, causal: bool, num_splits: int | None) -> None:
    _check(triton_device, torch.float32, *_SHAPES[name], causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("num_splits", [1, 3, 9], ids=lambda n: f"splits{n}")
def test_forced_splits(triton_device: str, causal: bool, num_splits: int) -> None:
    # 2 rows: 3 and 253 keys (4 key blocks of 64): 3 splits give row 1 slices of 2, 2 and 0
    # blocks; 9 splits are more slices than keys for row 0 and than key blocks for row 1
    _check(triton_device, torch.float32, 2, 3, 4, 1, 16, 256, [0, 250], [1, 3], causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"splits{n}")
def test_large_scores(triton_device: str, num_splits: int) -> None:
    # scores of several hundred: exp without the running-max shift would overflow fp32 (the
    # tolerance is looser: fp32 rounding of such scores alone moves the probabilities by ~1e-5)
    q, k_cache, v_cache, slots, start = _inputs(triton_device, torch.float32, 1, 2, 4, 2, 16, 256, [200], [2])
    out = cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 40.0, num_splits=num_splits)
    ref = cache_attention_reference(q, k_cache, v_cache, LAYER, slots, start, True, 40.0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_split_with_padding_row(triton_device: str) -> None:
    _check(triton_device, torch.float32, 2, 2, 4, 2, 16, 32, [9, 4], [-1, 2], causal=True, num_splits=4)


@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "nosplit", "splits3"])
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False)], ids=["decode", "verify", "draft"])
def test_parity_bf16(triton_device: str, T: int, causal: bool, num_splits: int | None) -> None:
    _check(triton_device, torch.bfloat16, 2, T, 8, 2, 64, 192, [17, 180], [3, -1], causal=causal, num_splits=num_splits)


def test_parity_fp16(triton_device: str) -> None:
    _check(triton_device, torch.float16, 2, 3, 4, 2, 16, 32, [1, 25], [0, 1], causal=True, num_splits=None)


def test_noncontiguous_q(triton_device: str) -> None:
    q, k_cache, v_cache, slots, start = _inputs(triton_device, torch.float32, 2, 3, 4, 2, 16, 32, [3, 20], [2, 0])
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, hd] view with heads outermost
    out = cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.3)
    ref = cache_attention_reference(q, k_cache, v_cache, LAYER, slots, start, True, 0.3)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# the split merge: fused into the attention kernel (default) or the combine kernel

def _both_merges(monkeypatch: pytest.MonkeyPatch, device: str, dtype: torch.dtype, B: int, T: int, n_heads: int,
                 n_kv: int, hd: int, S: int, starts: list[int], slots: list[int], causal: bool, num_splits: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused, kernel, reference) outputs of one call; the fused call leaves the counters zero."""
    q, k_cache, v_cache, slot_t, start = _inputs(device, dtype, B, T, n_heads, n_kv, hd, S, starts, slots, seed)
    scale = hd ** -0.5
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "kernel")
    kernel = cache_attention_triton(q, k_cache, v_cache, LAYER, slot_t, start, causal, scale, num_splits=num_splits)
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "fused")
    fused = cache_attention_triton(q, k_cache, v_cache, LAYER, slot_t, start, causal, scale, num_splits=num_splits)
    assert not _merge_counters(q.device).any(), "the last program of every unit resets its counter"
    ref = cache_attention_reference(q, k_cache, v_cache, LAYER, slot_t, start, causal, scale)
    pad = slot_t < 0
    if pad.any():
        assert (fused[pad] == 0).all(), "padding rows must be exactly zero"
    return fused, kernel, ref


# (B, T, n_heads, n_kv, hd, S, starts, slots, causal, num_splits): ragged starts, a padding row,
# GQA groups; few output rows, as the combine kernel runs one (interpreted) program per row
_MERGE_CASES = {
    "decode_g4_splits7": (2, 1, 8, 2, 16, 200, [5, 190], [2, -1], True, 7),
    "verify_t10_g2_splits3": (2, 10, 2, 1, 16, 200, [0, 150], [-1, 3], True, 3),
    "draft_t9_noncausal_g2_splits2": (1, 9, 2, 1, 16, 200, [185], [0], False, 2),
    "verify_clip_g1_splits5": (1, 10, 2, 2, 32, 130, [125], [3], True, 5),   # window runs past the cache end
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(_MERGE_CASES))
def test_fused_merge_is_bit_identical_to_the_combine_kernel(monkeypatch: pytest.MonkeyPatch, triton_device: str,
                                                            name: str, dtype: torch.dtype) -> None:
    """Both merges take every element through the same operations in the same order (module doc), so
    the one-launch path computes exactly what the two-launch path does, and both match the reference
    (fp32: a sum in another order would show; bf16: the production dtype)."""
    *shape, causal, num_splits = _MERGE_CASES[name]
    fused, kernel, ref = _both_merges(monkeypatch, triton_device, dtype, *shape, causal=causal, num_splits=num_splits)
    assert torch.equal(fused, kernel)
    torch.testing.assert_close(fused, ref, **_tol(dtype))


@pytest.mark.parametrize("num_splits", [1, 5, 33], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False)], ids=["decode", "verify", "draft"])
def test_fused_merge_parity(triton_device: str, T: int, causal: bool, num_splits: int) -> None:
    # the default mode; 33 splits: more slices than key blocks for every row (empty trailing
    # slices store neutral partials) and more than one merge step at any tile
    _check(triton_device, torch.float32, 3, T, 8, 2, 16, 1100, [0, 700, 1090], [1, -1, 2], causal=causal,
           num_splits=num_splits)
    assert not _merge_counters(torch.device(triton_device)).any()


def test_fused_merge_step_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    """``attention.merge_step`` changes how many partials are requested at once, not the sum's order."""
    monkeypatch.delenv("LFMSPARK_TUNE", raising=False)
    q, k_cache, v_cache, slots, start = _inputs(triton_device, torch.float32, 1, 10, 4, 2, 16, 600, [580], [2])
    default = cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25, num_splits=9)
    for step in (1, 4, 64):
        monkeypatch.setenv("LFMSPARK_TUNE", f"attention.merge_step={step}")
        assert torch.equal(cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25,
                                                  num_splits=9), default), step


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the interpreter's program order")
def test_fused_merge_does_not_depend_on_arrival_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter runs a unit's splits in order, so the last split arrives last. Run them
    backwards (split 0 merges): bit-identical, because the merge reads the partials in split order
    whoever runs it."""
    from triton.runtime import interpreter

    q, k_cache, v_cache, slots, start = _inputs("cpu", torch.float32, 2, 10, 4, 2, 16, 300, [30, 280], [3, 1])
    forward = cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25, num_splits=5)
    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx
    order = []

    def backwards(x: int, y: int, z: int) -> None:
        order.append(builder.grid_dim[2] - 1 - z)
        set_grid_idx(x, y, builder.grid_dim[2] - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", backwards)
    assert torch.equal(cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25, num_splits=5),
                       forward)
    assert order[0] == 4 and order[-1] == 0  # really ran backwards
    assert not _merge_counters(torch.device("cpu")).any()


def test_combine_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LFMSPARK_ATTENTION_COMBINE``: ``fused`` by default, read at each call, misspellings refused by name."""
    verify, prefill = (1, 10, 32, 8, 64, 960, 2, 132), (16, 128, 32, 8, 64, 960, 2, 132)
    monkeypatch.delenv("LFMSPARK_TUNE", raising=False)
    monkeypatch.delenv("LFMSPARK_ATTENTION_COMBINE", raising=False)
    assert attention_combine() == "fused"
    fused = plan_launch(*verify)
    assert fused.split and fused.fused_merge and fused.merge_step == 4         # 64-row tile, head_dim 64
    assert not plan_launch(*prefill).fused_merge and plan_launch(*prefill).merge_step == 0
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "kernel")
    kernel = plan_launch(*verify)
    assert not kernel.fused_merge and kernel.merge_step == 16 and kernel.variant != fused.variant
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "two-kernel")
    with pytest.raises(ValueError, match=r"LFMSPARK_ATTENTION_COMBINE='two-kernel'.*'fused'.*'kernel'"):
        plan_launch(*verify)


def test_fused_merge_unit_limit(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    """A fused-merge launch with more units than counters is refused before it runs."""
    monkeypatch.setattr(ca, "MAX_MERGE_UNITS", 3)
    q, k_cache, v_cache, slots, start = _inputs(triton_device, torch.float32, 2, 1, 4, 2, 16, 64, [3, 9], [0, 1])
    with pytest.raises(ValueError, match="over 4 .* units: at most 3"):
        cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25, num_splits=2)
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "kernel")   # no counters: no limit
    cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, 0.25, num_splits=2)


# ---------------------------------------------------------------------------------------------
# op registration, torch.compile

def _op_args() -> tuple:
    q, k_cache, v_cache, slots, start = _inputs("cpu", torch.float32, 2, 3, 4, 2, 16, 32, [4, 29], [1, -1])
    return (q, k_cache, v_cache, LAYER, slots, start, True, 0.25)


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, _op_args())


def test_opcheck_triton_fused_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split launch (5 splits on the interpreter's 8 "SMs") merged in the attention kernel: the
    counters it updates are left as found, so the op still declares no mutation."""
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    monkeypatch.delenv("LFMSPARK_ATTENTION_COMBINE", raising=False)
    q, k_cache, v_cache, slots, start = _inputs("cpu", torch.float32, 1, 2, 4, 2, 16, 300, [250], [1])
    assert plan_launch(1, 2, 4, 2, 16, 300, 4, ca._sm_count(q.device)).fused_merge
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, (q, k_cache, v_cache, LAYER, slots, start, True, 0.25))


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    q, k_cache, v_cache, layer, slots, start, causal, scale = _op_args()

    def attend(q, k_cache, v_cache, slots, start):
        return torch.ops.lfmspark.cache_attention(q, k_cache, v_cache, layer, slots, start, causal, scale)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    eager = attend(q, k_cache, v_cache, slots, start)
    torch.testing.assert_close(compiled(q, k_cache, v_cache, slots, start), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, cache_attention_reference(q, k_cache, v_cache, layer, slots, start, causal,
                                                                scale), **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# CUDA: LFM2.5-1.2B shapes (32 heads, 8 kv heads, head_dim 64, 8192 positions)

_GPU = dict(n_heads=32, n_kv=8, hd=64, S=8192)
_GPU_STARTS, _GPU_SLOTS = [0, 511, 8191 - 10, 4000], [3, 0, 2, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False), (300, True)],
                         ids=["decode", "verify", "draft", "prefill"])
@pytest.mark.parametrize("num_splits", [None, 1, 16], ids=["auto", "nosplit", "splits16"])
def test_gpu_parity(dtype: torch.dtype, T: int, causal: bool, num_splits: int | None) -> None:
    _check("cuda", dtype, 4, T, _GPU["n_heads"], _GPU["n_kv"], _GPU["hd"], _GPU["S"], _GPU_STARTS, _GPU_SLOTS,
           causal=causal, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_parity_batch(B: int) -> None:
    starts = [(997 * i) % 8000 for i in range(B)]
    slots = [i % SLOTS if i % 5 != 4 else -1 for i in range(B)]
    _check("cuda", torch.bfloat16, B, 1, _GPU["n_heads"], _GPU["n_kv"], _GPU["hd"], _GPU["S"], starts, slots,
           causal=True, num_splits=None)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto", "nosplit"])
def test_gpu_cuda_graph_follows_indices(num_splits: int | None) -> None:
    B, T = 2, 10
    q, k_cache, v_cache, slots, start = _inputs("cuda", torch.bfloat16, B, T, _GPU["n_heads"], _GPU["n_kv"],
                                                _GPU["hd"], _GPU["S"], [100, 6000], [1, 2])
    scale = _GPU["hd"] ** -0.5

    def attend():
        if num_splits is None:  # the op itself (default heuristic: split path at B = 2)
            return torch.ops.lfmspark.cache_attention(q, k_cache, v_cache, LAYER, slots, start, True, scale)
        return cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, True, scale, num_splits=num_splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()

    for new_start, new_slots in [([100, 6000], [1, 2]), ([8100, 3], [0, -1]), ([0, 7777], [-1, 3])]:
        start.copy_(torch.tensor(new_start))
        slots.copy_(torch.tensor(new_slots))
        graph.replay()
        torch.cuda.synchronize()
        ref = cache_attention_reference(q, k_cache, v_cache, LAYER, slots, start, True, scale)
        torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
        assert (out[slots < 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False)], ids=["decode", "verify", "draft"])
@pytest.mark.parametrize("num_splits", [None, 7, 64], ids=["auto", "splits7", "splits64"])
def test_gpu_fused_merge_is_bit_identical_and_deterministic(monkeypatch: pytest.MonkeyPatch, T: int, causal: bool,
                                                            num_splits: int | None) -> None:
    """On the GPU any split program may arrive last: 50 fused calls (eager, then as many CUDA-graph
    replays) all equal the combine kernel's result bit for bit, and leave the counters zero."""
    B = 1 if num_splits is None else 4   # batch 1: the heuristic's ~15 splits per (row tile, kv head)
    q, k_cache, v_cache, slots, start = _inputs("cuda", torch.bfloat16, B, T, _GPU["n_heads"], _GPU["n_kv"],
                                                _GPU["hd"], _GPU["S"], _GPU_STARTS[:B], _GPU_SLOTS[:B])
    scale = _GPU["hd"] ** -0.5

    def attend() -> torch.Tensor:
        return cache_attention_triton(q, k_cache, v_cache, LAYER, slots, start, causal, scale, num_splits=num_splits)

    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "kernel")
    want = attend()
    monkeypatch.setenv("LFMSPARK_ATTENTION_COMBINE", "fused")
    assert plan_launch(B, T, _GPU["n_heads"], _GPU["n_kv"], _GPU["hd"], _GPU["S"], 2,
                       ca._sm_count(q.device), num_splits).fused_merge
    for _ in range(50):
        assert torch.equal(attend(), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert not _merge_counters(q.device).any()
    torch.testing.assert_close(want, cache_attention_reference(q, k_cache, v_cache, LAYER, slots, start, causal,
                                                               scale), **_tol(torch.bfloat16))
