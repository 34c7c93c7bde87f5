"""``lfmspark::argmax_rows``: the two-stage Triton row argmax (interpreter on CPU, native on CUDA)
against ``torch.argmax``, compared exactly: random rows, ties across and within blocks, ``-inf``,
``+inf``, NaN, signed zeros, a chunked second stage, strided inputs; registration checks and
torch.compile.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops import argmax_rows as argmax_rows_module
from lfmspark.ops.argmax_rows import argmax_block_v, argmax_last, argmax_rows_reference, argmax_rows_triton
from env_vars import interpret_triton

NAN, INF = float("nan"), float("inf")


def _same(x: torch.Tensor, block_v: int | None = None) -> None:
    out = argmax_rows_triton(x, block_v)
    assert out.dtype == torch.int64 and out.shape == x.shape[:1] and out.device == x.device
    assert torch.equal(out, torch.argmax(x, dim=-1)), (out, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("R", [1, 3, 10, 33])
@pytest.mark.parametrize("V", [1, 7, 256, 1000, 4099])
def test_random_rows(triton_device: str, R: int, V: int) -> None:
    g = torch.Generator().manual_seed(R * 7919 + V)
    _same(torch.randn(R, V, generator=g).to(triton_device))


@pytest.mark.parametrize("R", [1, 2])
def test_served_vocabulary(triton_device: str, R: int) -> None:
    x = torch.randn(R, 65536, generator=torch.Generator().manual_seed(R)).to(triton_device)
    _same(x)


@pytest.mark.parametrize("max_block_p", [16, 1024])
@pytest.mark.parametrize("block_v", [64, 256])
def test_forced_blocks_and_chunked_second_stage(triton_device: str, monkeypatch: pytest.MonkeyPatch,
                                                block_v: int, max_block_p: int) -> None:
    """Many column blocks; with at most 16 partials per step (``_MAX_BLOCK_P``, 1024 in use) the
    second stage loops over several chunks of partials (79 or 20 per row here)."""
    monkeypatch.setattr(argmax_rows_module, "_MAX_BLOCK_P", max_block_p)
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(block_v)).to(triton_device)
    x[1, 4990] = 100.0        # the maximum in the last chunk of partials
    x[2, 5] = 100.0           # a tie between the first and the last chunk: the first index wins
    x[2, 4900] = 100.0
    _same(x, block_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs_tie_often(triton_device: str, dtype: torch.dtype) -> None:
    """bf16 / fp16 rows (compared in fp32, exactly): rounding makes many equal maxima."""
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1)).round().to(triton_device, dtype)
    _same(x, 256)
    _same(x)


def _special_rows() -> torch.Tensor:
    """Rows of 700 columns (three 256-wide blocks) with ties, infinities, NaN and signed zeros."""
    rows = []

    def row(**set_at) -> None:
        r = torch.full((700,), -5.0)
        for i, v in set_at.items():
            r[int(i[1:])] = v
        rows.append(r)

    row(c10=3.0, c300=3.0, c699=3.0)              # tie across blocks: 10
    row(c300=3.0, c260=3.0, c270=3.0)             # tie within a block: 260
    row(c1=3.0, c600=INF, c650=INF)               # +inf wins, first one: 600
    row(c2=NAN, c3=INF)                           # NaN beats +inf: 2
    row(c3=INF, c500=NAN, c600=NAN)               # the first NaN, in a later block: 500
    row(c400=NAN, c200=NAN, c100=9.0)             # two NaN blocks: the first NaN, 200
    r = torch.zeros(700)
    r[:350] = -0.0
    rows.append(r)                                # -0.0 == 0.0: index 0
    rows.append(torch.full((700,), -INF))         # all -inf: 0
    r = torch.full((700,), -INF)
    r[513] = -1e30
    rows.append(r)                                # one finite value among -inf: 513
    r = torch.full((700,), -INF)
    r[640] = NAN
    rows.append(r)                                # a NaN among -inf: 640
    rows.append(torch.full((700,), 2.5))          # constant row: 0
    return torch.stack(rows)


def test_ties_infinities_nan_and_signed_zeros(triton_device: str) -> None:
    x = _special_rows().to(triton_device)
    want = [10, 260, 600, 2, 500, 200, 0, 0, 513, 640, 0]
    assert torch.argmax(x.cpu(), dim=-1).tolist() == want       # the semantics the kernel must match
    for block_v in (256, 64, None):
        _same(x, block_v)


def test_strided_rows(triton_device: str) -> None:
    """Rows as a column slice of a wider tensor (row stride > V), and a transposed view (column
    stride != 1: made contiguous)."""
    wide = torch.randn(4, 3000, generator=torch.Generator().manual_seed(2)).to(triton_device)
    _same(wide[:, 1000:2300])
    _same(torch.randn(500, 6, device=triton_device).T)


def test_argmax_last_keeps_leading_shape(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x = torch.randn(3, 10, 777, generator=torch.Generator().manual_seed(3)).to(triton_device)
    out = argmax_last(x)
    assert out.shape == (3, 10) and torch.equal(out, x.argmax(dim=-1))
    assert torch.equal(argmax_last(x[:, 0]), x[:, 0].argmax(dim=-1))


def test_empty_batch_and_rejects(triton_device: str) -> None:
    assert argmax_rows_triton(torch.empty(0, 50, device=triton_device)).shape == (0,)
    with pytest.raises(ValueError, match="empty row"):
        argmax_rows_triton(torch.empty(3, 0, device=triton_device))
    with pytest.raises(ValueError, match="empty row"):
        torch.ops.lfmspark.argmax_rows(torch.empty(3, 0))     # the reference path has the same limits
    with pytest.raises(ValueError, match="floating-point"):
        argmax_rows_triton(torch.zeros(2, 5, dtype=torch.int64, device=triton_device))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        argmax_rows_triton(torch.zeros(2, 3, 5, device=triton_device))


def test_block_heuristic() -> None:
    """V = 65536 on 132 SMs: 256 programs of 256 columns for one row; wider blocks for more rows,
    within [256, 4096]."""
    assert argmax_block_v(1, 65536, 132) == 256
    assert argmax_block_v(10, 65536, 132) == 2048
    assert argmax_block_v(64, 65536, 132) == 4096
    assert argmax_block_v(1, 100, 132) == 256


# ---------------------------------------------------------------------------------------------
# op registration, dispatch, torch.compile

def _op_args() -> tuple[torch.Tensor]:
    return (torch.randn(4, 900, generator=torch.Generator().manual_seed(4)),)


def test_cpu_dispatch_is_the_reference() -> None:
    (x,) = _op_args()
    assert torch.equal(torch.ops.lfmspark.argmax_rows(x), argmax_rows_reference(x))


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.argmax_rows, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.argmax_rows, _op_args())


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(5))

    def pick(x):
        return argmax_last((x * 2).float()) + 1

    torch._dynamo.reset()
    compiled = torch.compile(pick, fullgraph=True)
    assert torch.equal(compiled(x), x.argmax(dim=-1) + 1)


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes, CUDA-graph replay

@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4, 10, 40, 160])
def test_gpu_served_shapes(R: int) -> None:
    x = torch.randn(R, 65536, device="cuda")
    x[:, 1000] = x[:, 60000] = x.max(dim=-1).values + 1    # a cross-block tie in every row
    assert torch.equal(torch.ops.lfmspark.argmax_rows(x), x.argmax(dim=-1))
    _same(_special_rows().cuda())


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_input() -> None:
    x = torch.randn(10, 65536, device="cuda")
    torch.ops.lfmspark.argmax_rows(x)                       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.lfmspark.argmax_rows(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1))
