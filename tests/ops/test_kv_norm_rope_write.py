"""``lfmspark::kv_norm_rope_write``: Triton kernel (interpreter on CPU, native on CUDA) against the
plain-PyTorch reference, op registration checks, torch.compile and CUDA-graph replay.

Every run starts from paged caches (shuffled page tables, a few physical pages mapped by no slot;
tests/ops/test_cache_attention.py ``paged``) filled with a sentinel and checks that exactly the
expected ``(layer, slot, position)`` rows were written (from an index walk independent of the
reference's own) and that everything else, the unmapped pages included, is untouched.

Exactness: on CUDA the kernel must equal the reference bit for bit (bf16, fp16 and fp32, head_dim
<= 64): it performs the reference's fp32 operations one by one without FMA contraction, rounds where
the reference rounds, uses the same hardware rsqrt and adds ``mean(x^2)`` in the order of torch's
CUDA reduction. Under the CPU interpreter the reference's sum order and rsqrt (CPU kernels) differ
from the kernel's in the last fp32 bit, so fp32 is compared tightly and bf16 to within one bf16 ulp
(rarely more than zero: the kernel rounds bf16 by hand there, since the interpreter's casts truncate).
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.attention.kv_norm_rope_write import kv_norm_rope_write_reference, kv_norm_rope_write_triton
from lfmspark.ops.attention.rope import rope_cos_sin_table
from env_vars import interpret_triton
from test_cache_attention import shuffled_table

EPS = 1e-5
THETA = 1e6
SENTINEL = -768.0  # exact in every float dtype, far outside what the op writes for these inputs


class Case:
    """Random inputs and sentinel-filled paged caches for one call (positions ``start[b] + t``): pages
    of ``page`` positions (default 4: windows cross pages), shuffled, or with ``page == S`` and
    ``dense`` the dense layout (one page per slot, the identity table)."""

    def __init__(self, device: str, dtype: torch.dtype, B: int, T: int, n: int, first_layer: int, n_kv: int,
                 hd: int, S: int, slots: list[int], start: list[int], lens: list[int], is_neox: bool,
                 seed: int = 0, n_layers: int | None = None, n_slots: int = 4, index_dtype=torch.int32,
                 page: int = 4, dense: bool = False):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.n_layers = n_layers if n_layers is not None else first_layer + n + 1  # a layer after the window
        # per-head scales spread over ~two decades, so the RMS statistic matters; never zero
        scale = torch.exp(torch.randn(B, T, n, 2, n_kv, 1, generator=g))
        self.kv = (torch.randn(B, T, n, 2, n_kv, hd, generator=g) * scale).reshape(B, T, -1).to(device, dtype)
        self.weight = (1.0 + 0.5 * torch.randn(self.n_layers, hd, generator=g)).to(device, dtype)
        self.cos_sin = rope_cos_sin_table(S + 8, hd, THETA, device=device)
        self.dense_shape = (self.n_layers, n_slots, S, n_kv, hd)
        if dense:
            assert page == S
            self.table = torch.arange(n_slots, dtype=torch.int32, device=device)[:, None]
        else:
            self.table = shuffled_table(n_slots, S // page, seed).to(device)
        n_pages = n_slots * (S // page) + (0 if dense else 2)
        self.cache_shape = (self.n_layers, n_pages, page, n_kv, hd)
        self.dtype, self.device = dtype, device
        self.first_layer, self.n, self.T, self.S, self.is_neox = first_layer, n, T, S, is_neox
        self.slots_l, self.start_l, self.lens_l = slots, start, lens
        self.slots, self.start, self.lens = (torch.tensor(x, dtype=index_dtype, device=device)
                                             for x in (slots, start, lens))

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full(self.cache_shape, SENTINEL, dtype=self.dtype, device=self.device),
                torch.full(self.cache_shape, SENTINEL, dtype=self.dtype, device=self.device))

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (self.kv, self.weight, self.cos_sin, k_cache, v_cache, self.table, self.first_layer, self.slots,
                self.start, self.lens, EPS, self.is_neox)

    def logical(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` in slot order, ``[L, n_slots, S, n_kv, hd]`` (the dense layout's view)."""
        return cache[:, self.table.long()].flatten(2, 3)

    def unmapped(self, cache: torch.Tensor) -> torch.Tensor:
        """The physical pages no slot maps."""
        free = torch.ones(cache.shape[1], dtype=torch.bool, device=cache.device)
        free[self.table.flatten().long()] = False
        return cache[:, free]

    def run(self, fn) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.caches()
        fn(*self.args(k_cache, v_cache))
        return k_cache, v_cache

    def expected_mask(self) -> torch.Tensor:
        """``[L, n_slots, S]``: the rows the op must write, from a plain walk over the indices."""
        mask = torch.zeros(self.dense_shape[:3], dtype=torch.bool)
        for slot, start, n_tok in zip(self.slots_l, self.start_l, self.lens_l):
            for t in range(min(n_tok, self.T)):
                if slot >= 0 and start + t < self.S:
                    mask[self.first_layer:self.first_layer + self.n, slot, start + t] = True
        return mask.to(self.device)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at ``|x|`` (8 significant bits)."""
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def _check(case: Case, exact: bool | None = None) -> None:
    """Kernel vs reference from sentinel caches: written rows, untouched rows, values."""
    exact = case.device == "cuda" if exact is None else exact
    k_ref, v_ref = case.run(kv_norm_rope_write_reference)
    k_out, v_out = case.run(kv_norm_rope_write_triton)
    for cache in (k_ref, v_ref, k_out, v_out):   # pages no slot maps: untouched
        assert bool((case.unmapped(cache) == SENTINEL).all())
    k_ref, v_ref, k_out, v_out = (case.logical(c) for c in (k_ref, v_ref, k_out, v_out))
    mask = case.expected_mask()
    n_rows = int(mask.sum())
    # the reference writes exactly the expected rows (sanity of the oracle and of the walk)
    assert bool((k_ref[mask] != SENTINEL).all()) and bool((k_ref[~mask] == SENTINEL).all())
    # nothing outside the expected rows changed; every expected row was written
    assert bool((k_out[~mask] == SENTINEL).all()) and bool((v_out[~mask] == SENTINEL).all())
    assert bool((k_out[mask] != SENTINEL).all())
    # V: an exact copy
    assert torch.equal(v_out, v_ref)
    a, b = k_out[mask].float(), k_ref[mask].float()
    assert a.shape[0] == n_rows and bool(torch.isfinite(a).all())
    if exact:
        assert torch.equal(k_out, k_ref), f"{int((a != b).sum())} of {a.numel()} K elements differ"
    elif case.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        err = (a - b).abs() / _bf16_ulp(torch.maximum(a.abs(), b.abs()))
        assert float(err.max()) <= 1.0, f"{float(err.max())} bf16 ulp"


# ---------------------------------------------------------------------------------------------
# parity on tiny shapes (interpreter on CPU; the same cases run natively and bit-exact on CUDA)

# (B, T, n, first_layer, n_kv, hd, S, slots, start, lens)
_SHAPES = {
    # decode-like: one token, 3 layers after layer 1, two kv heads
    "t1_n3": (2, 1, 3, 1, 2, 64, 16, [3, 0], [0, 15], [1, 1]),
    # padding row in the middle, last row's window runs past the cache end (16 is not written)
    "t3_pad_clip": (3, 3, 1, 0, 2, 64, 16, [2, -1, 0], [0, 4, 14], [3, 3, 3]),
    # commit masks: nothing, part and the full width of a 10-token window; small heads, layer 2 of 1
    "t10_commit": (3, 10, 1, 2, 1, 16, 24, [1, 3, 0], [0, 2, 13], [0, 7, 10]),
    # lens past T, three kv heads (not a power of two) of 32, first layer 0 of 1
    "t3_hd32": (2, 3, 1, 0, 3, 32, 8, [0, 1], [5, 0], [5, 2]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("name", list(_SHAPES))
def test_parity(triton_device: str, name: str, is_neox: bool, dtype: torch.dtype) -> None:
    B, T, n, first, n_kv, hd, S, slots, start, lens = _SHAPES[name]
    seed = 4 * list(_SHAPES).index(name) + 2 * is_neox + (dtype == torch.bfloat16)  # fresh inputs per case
    _check(Case(triton_device, dtype, B, T, n, first, n_kv, hd, S, slots, start, lens, is_neox, seed=seed))


def test_int64_indices_and_strided_kv(triton_device: str) -> None:
    case = Case(triton_device, torch.bfloat16, 2, 3, 2, 0, 2, 16, 8, [1, 0], [2, 6], [3, 1], False,
                seed=7, index_dtype=torch.int64)
    # kv as a column slice of a wider projection output (row stride != width)
    wide = torch.randn(2, 3, case.kv.shape[-1] + 24, device=triton_device).to(case.dtype)
    wide[..., 8:8 + case.kv.shape[-1]] = case.kv
    case.kv = wide[..., 8:8 + case.kv.shape[-1]]
    assert not case.kv.is_contiguous()
    _check(case)


def test_all_rows_skipped(triton_device: str) -> None:
    # every token masked one way or another: the caches must stay untouched
    case = Case(triton_device, torch.float32, 3, 2, 2, 0, 1, 16, 8, [-1, 1, 2], [0, 1, 8], [2, 0, 2], True, seed=3)
    k_out, v_out = case.run(kv_norm_rope_write_triton)
    assert bool((k_out == SENTINEL).all()) and bool((v_out == SENTINEL).all())


@pytest.mark.parametrize("page", [16, 4], ids=lambda n: f"page{n}")
def test_paged_equals_dense_layout(triton_device: str, page: int) -> None:
    """The same call on shuffled pages and on the dense layout (one page per slot, the identity
    table), fp32: the same bits in every slot position. Pages of 16 split row 0's window (13-18), row
    1's runs past the slot end, row 2 pads; pages of 4 split every window."""
    shape = (torch.float32, 3, 6, 2, 0, 2, 16, 32, [1, 3, -1], [13, 28, 0], [6, 6, 6], True)
    case = Case(triton_device, *shape, seed=5, page=page)
    dense = Case(triton_device, *shape, seed=5, page=32, dense=True)
    k_out, v_out = case.run(kv_norm_rope_write_triton)
    k_want, v_want = dense.run(kv_norm_rope_write_triton)
    assert torch.equal(case.logical(k_out), k_want) and torch.equal(case.logical(v_out), v_want)
    _check(case)


# ---------------------------------------------------------------------------------------------
# op registration, torch.compile

def _op_case(device: str = "cpu", is_neox: bool = False) -> Case:
    return Case(device, torch.float32, 2, 3, 2, 1, 2, 16, 8, [1, -1], [4, 0], [2, 3], is_neox, seed=11)


def test_page_table_is_checked() -> None:
    case = _op_case()
    k_cache, v_cache = case.caches()
    table = case.table
    for bad, message in ((table.long(), "int32"), (table[0], "2-D"),
                         (torch.stack([table, table], -1)[..., 0], r"stride\(1\) == 1"),
                         (table.to("meta"), "page_table is on meta")):
        case.table = bad
        with pytest.raises(ValueError, match=message):
            kv_norm_rope_write_triton(*case.args(k_cache, v_cache))


def test_opcheck_reference() -> None:
    case = _op_case()
    torch.library.opcheck(torch.ops.lfmspark.kv_norm_rope_write, case.args(*case.caches()))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    interpret_triton(monkeypatch)
    case = _op_case(triton_device)
    torch.library.opcheck(torch.ops.lfmspark.kv_norm_rope_write, case.args(*case.caches()))


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    interpret_triton(monkeypatch)
    case = _op_case(triton_device, is_neox=True)
    first = case.first_layer

    def write(kv, weight, cos_sin, k_cache, v_cache, table, slots, start, lens):
        torch.ops.lfmspark.kv_norm_rope_write(kv, weight, cos_sin, k_cache, v_cache, table, first, slots, start, lens,
                                              EPS, True)

    torch._dynamo.reset()
    compiled = torch.compile(write, fullgraph=True)
    k_eager, v_eager = case.caches()
    write(case.kv, case.weight, case.cos_sin, k_eager, v_eager, case.table, case.slots, case.start, case.lens)
    k_comp, v_comp = case.caches()
    compiled(case.kv, case.weight, case.cos_sin, k_comp, v_comp, case.table, case.slots, case.start, case.lens)
    assert torch.equal(k_comp, k_eager) and torch.equal(v_comp, v_eager)
    # and the eager op ran the kernel: its result is the kernel's (the reference's only up to ulps on CPU)
    k_kernel, v_kernel = case.run(kv_norm_rope_write_triton)
    assert torch.equal(k_eager, k_kernel) and torch.equal(v_eager, v_kernel)
    _check(case)


# ---------------------------------------------------------------------------------------------
# CUDA: LFM2.5-1.2B DSpark draft shapes (5 layers, 8 kv heads, head_dim 64)

def _draft_case(B: int, T: int, dtype: torch.dtype, is_neox: bool, seed: int, S: int = 256,
                n_slots: int = 24) -> Case:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_slots, generator=g)[:B].tolist()
    for b in range(4, B, 5):
        slots[b] = -1  # padding rows
    start = torch.randint(0, S - T // 2, (B,), generator=g).tolist()  # some windows cross S
    lens = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lens[-1] = T
    return Case("cuda", dtype, B, T, 5, 0, 8, 64, S, slots, start, lens, is_neox, seed=seed, n_layers=5,
                n_slots=n_slots, page=16)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("B,T", [(16, 10), (4, 10), (1, 1), (2, 512)], ids=["b16t10", "b4t10", "b1t1", "b2t512"])
def test_gpu_bit_exact_bf16(B: int, T: int, is_neox: bool) -> None:
    # (1, 1) runs torch's reduction through its shared-memory path (few rows): same order for hd 64
    for seed in range(3):
        _check(_draft_case(B, T, torch.bfloat16, is_neox, seed, S=1024 if T > 64 else 256), exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_bit_exact_other_dtypes(dtype: torch.dtype) -> None:
    _check(_draft_case(16, 10, dtype, False, 5), exact=True)


@pytest.mark.gpu
def test_gpu_op_dispatches_to_kernel() -> None:
    case = _draft_case(4, 10, torch.bfloat16, False, 9)
    k_op, v_op = case.run(torch.ops.lfmspark.kv_norm_rope_write)
    k_ref, v_ref = case.run(kv_norm_rope_write_reference)
    assert torch.equal(k_op, k_ref) and torch.equal(v_op, v_ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_follows_indices() -> None:
    case = _draft_case(4, 10, torch.bfloat16, False, 1)
    k_cache, v_cache = case.caches()
    args = case.args(k_cache, v_cache)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.lfmspark.kv_norm_rope_write(*args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.lfmspark.kv_norm_rope_write(*args)

    for slots, start, lens in [([3, 0, -1, 7], [0, 250, 9, 30], [10, 10, 4, 1]),
                               ([-1, 5, 2, 0], [100, 0, 247, 3], [3, 0, 10, 10]),
                               ([1, 2, 3, 4], [0, 1, 2, 3], [1, 2, 3, 4])]:
        case.slots_l, case.start_l, case.lens_l = slots, start, lens
        for dst, src in ((case.slots, slots), (case.start, start), (case.lens, lens)):
            dst.copy_(torch.tensor(src))  # in place: the graph reads these tensors
        case.kv.copy_(torch.randn_like(case.kv))
        k_cache.fill_(SENTINEL)
        v_cache.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        k_ref, v_ref = case.run(kv_norm_rope_write_reference)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        mask, k_slots = case.expected_mask(), case.logical(k_cache)
        assert bool((k_slots[mask] != SENTINEL).all()) and bool((k_slots[~mask] == SENTINEL).all())
        assert bool((case.unmapped(k_cache) == SENTINEL).all())
