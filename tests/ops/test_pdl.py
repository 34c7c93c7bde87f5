"""Programmatic dependent launch (ops/_dispatch.py): the kill switch, the trigger of each kind of kernel, and on the GPU that a chain of
PDL kernels replayed from a CUDA graph computes exactly what the same kernels compute without PDL.

A kernel that read its predecessor's output before ``gdc_wait`` would read stale or partial data in
the graph replay (where the successor really starts early), so the bit-exact comparison of long,
dependent chains is the check that every kernel in the chain honours the contract.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark import environment
from lfmspark.ops._dispatch import pdl_kwargs, use_pdl
from env_vars import set_env

lfm = torch.ops.lfmspark


def test_off_on_cpu() -> None:
    assert not use_pdl(torch.zeros(1))
    assert pdl_kwargs(torch.zeros(1)) == {"PDL": 0, "launch_pdl": False}


def test_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, PDL=None)
    assert environment.environment().pdl
    set_env(monkeypatch, PDL="0")
    assert not environment.environment().pdl
    with pytest.raises(ValueError, match="LFMSPARK_PDL='yes'"):
        set_env(monkeypatch, PDL="yes")


def test_trigger_of_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Late (2) in the one-row products, at entry (1) elsewhere; 0 off the GPU."""
    from lfmspark.ops import _dispatch

    assert pdl_kwargs(torch.zeros(1), one_row_product=True)["PDL"] == 0
    monkeypatch.setattr(_dispatch, "use_pdl", lambda t: True)
    assert pdl_kwargs(torch.zeros(1)) == {"PDL": 1, "launch_pdl": True}
    assert pdl_kwargs(torch.zeros(1), one_row_product=True) == {"PDL": 2, "launch_pdl": True}


class _PdlRecorder:
    """Stands in for a kernel: records the ``PDL`` constexpr of each launch instead of launching."""

    def __init__(self, name: str, seen: dict[str, int]):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen[self.name] = kwargs["PDL"]
        return launch


def test_launchers_pass_the_trigger_of_their_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-row products (GEMV, fused-norm GEMV) launch with the late trigger, the several-row
    tile products with the trigger at entry."""
    from lfmspark.ops import _dispatch
    from lfmspark.ops.linear import add_rmsnorm_gemv, skinny_linear

    monkeypatch.setattr(_dispatch, "use_pdl", lambda t: True)
    seen: dict[str, int] = {}
    for module, name in [(skinny_linear, "_gemv_kernel"), (skinny_linear, "_skinny_linear_kernel"),
                         (add_rmsnorm_gemv, "_add_rmsnorm_gemv_kernel")]:
        monkeypatch.setattr(module, name, _PdlRecorder(name, seen))
    K = 64
    x, w, w13 = torch.ones(1, K), torch.ones(256, K), torch.ones(512, K)
    skinny_linear.skinny_linear_triton(x, w, skinny_linear.SkinnyConfig(block_n=16, block_k=K, gemv=True))
    skinny_linear.skinny_linear_triton(x.expand(10, K), w)
    skinny_linear.skinny_swiglu_triton(x, w13)                          # one row: the tile kernel
    skinny_linear.skinny_linear_pair_triton(x.expand(10, K), w, w13)
    add_rmsnorm_gemv.add_rmsnorm_gemv_triton(x, None, torch.ones(K), 1e-6, w, swiglu=False)
    assert seen == {"_gemv_kernel": 2, "_add_rmsnorm_gemv_kernel": 2, "_skinny_linear_kernel": 1}


def _chain(x: torch.Tensor, squares: list[torch.Tensor], w13: torch.Tensor, fan_out: torch.Tensor,
           w10: torch.Tensor) -> torch.Tensor:
    """Back-to-back lfmspark kernels with no other kernel between them (views are free), each
    consuming its predecessor's output: square GEMVs, the one-row SwiGLU, a GEMV whose output is
    viewed as 10 rows, a 10-row product (not split on 132 SMs; split-K chains in a graph:
    tests/ops/test_skinny_linear.py), the two-stage argmax."""
    h = x
    for w in squares:
        h = lfm.skinny_linear(h, w)
    h = lfm.skinny_swiglu(h, w13)                                 # [1, K] (F = K)
    ten = lfm.skinny_linear(h, fan_out).view(10, x.shape[1])      # [1, 10K] -> [10, K]
    out = lfm.skinny_linear(ten, w10)
    return out, lfm.argmax_rows(out)


@pytest.mark.gpu
def test_graph_replay_with_pdl_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 2048

    def rand(*shape: int) -> torch.Tensor:  # unit-scale outputs for unit-scale inputs
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) / shape[-1] ** 0.5

    x = rand(1, K) * K ** 0.5
    args = (x, [rand(K, K) for _ in range(12)], rand(2 * K, K), rand(10 * K, K), rand(8192, K))

    set_env(monkeypatch, PDL="0")
    want = _chain(*args)

    set_env(monkeypatch, PDL="1")
    assert use_pdl(x), "the GPU supports PDL (sm_90 or newer)"
    _chain(*args)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(*args)
    assert want[0].abs().max() > 0.1  # the chain did not decay to zeros (which would hide a race)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _norm_carry_chain(x: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, g_ffn: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, g_next: torch.Tensor, w_in: torch.Tensor,
                      w_a: torch.Tensor, w_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A verify layer's tail and the next layer's input products on the norm epilogues
    (models/layers.py ``NormedCarry``): out_proj with the residual and the feed-forward norm's
    statistics, the gate/up product with the row scale, w2 with the residual and the next norm's
    statistics, then two consumers of that carry (in_proj, the draft's q + K/V pair). Each kernel
    reads outputs of its predecessor and of kernels before it, weights and norm weights before its
    PDL wait."""
    s, scaled, ssq = lfm.skinny_linear_add_norm(x, w_o, residual, g_ffn)
    act = lfm.skinny_swiglu(scaled, w13, ssq, 1e-5)
    out, scaled, ssq = lfm.skinny_linear_add_norm(act, w2, s, g_next)
    return out, lfm.skinny_linear(scaled, w_in, ssq, 1e-5), lfm.skinny_linear_pair(scaled, w_a, w_b, ssq, 1e-5)


@pytest.mark.gpu
def test_norm_carry_chain_with_pdl_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm epilogues' producer / consumer chain (LFM2.5-1.2B's verify shapes, 10 rows; split-K
    fix-ups in out_proj and w2) replayed from a CUDA graph with PDL equals the chain without PDL."""
    g = torch.Generator(device="cuda").manual_seed(1)
    H, F = 2048, 8192

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * scale / shape[-1] ** 0.5

    norm_weight = [1 + 0.2 * torch.randn(H, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
    args = (rand(10, H, scale=H ** 0.5), rand(10, H, scale=H ** 0.5), rand(H, H), norm_weight[0], rand(2 * F, H),
            rand(H, F), norm_weight[1], rand(3 * H, H), rand(H, H), rand(H // 2, H))
    set_env(monkeypatch, PDL="0")
    want = _norm_carry_chain(*args)
    set_env(monkeypatch, PDL="1")
    _norm_carry_chain(*args)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _norm_carry_chain(*args)
    assert all(t.abs().max() > 0.1 for t in want)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_every_kernel_takes_the_pdl_constexpr() -> None:
    """Launchers pass ``PDL=`` to every kernel; the interpreter ignores unknown keywords, so a kernel
    missing the parameter only fails on a GPU. Checked here for all of ``lfmspark.ops``."""
    import importlib
    import pkgutil

    import triton

    import lfmspark.ops as ops_pkg

    kernels = []
    for info in pkgutil.walk_packages(ops_pkg.__path__, "lfmspark.ops."):
        module = importlib.import_module(info.name)
        kernels += [(info.name, name, obj) for name, obj in vars(module).items()
                    if isinstance(obj, triton.runtime.KernelInterface) and name.endswith("_kernel")
                    and getattr(obj, "fn", obj).__module__ == module.__name__]
    assert len(kernels) >= 15  # a discovery sanity bound: the ops' kernels in every family folder
    assert {mod.split(".")[2] for mod, _, _ in kernels} >= {"linear", "attention", "markov_walk", "moe", "short_conv"}
    missing = [f"{mod}.{name}" for mod, name, fn in kernels if "PDL" not in fn.arg_names]
    assert not missing, f"kernels without the PDL constexpr: {missing}"


@pytest.mark.gpu
def test_every_inductor_kernel_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Inductor's PDL on (graphs/compile.py), every generated kernel executes gdc_wait, also a
    kernel that only stores (``torch.ones`` here), which Inductor alone would emit without one."""
    from torch._inductor.utils import run_and_get_code

    from lfmspark.graphs.compile import configure_compile

    set_env(monkeypatch, PDL="1")
    configure_compile(n_variants=1)
    assert torch._inductor.config.triton.enable_pdl

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin() * 2, torch.ones(1000, device=x.device)

    torch._dynamo.reset()
    x = torch.randn(4096, device="cuda")
    (y, ones), sources = run_and_get_code(torch.compile(f, fullgraph=True), x)
    torch.testing.assert_close(y, x.sin() * 2)
    assert torch.equal(ones, torch.ones_like(ones))
    kernels = [chunk for src in sources for chunk in src.split("async_compile.triton(")[1:] if "def triton_" in chunk]
    assert len(kernels) >= 2 and any("tl.load" not in k.split("''')")[0] for k in kernels)
    assert all("gdc_wait" in k for k in kernels), "an Inductor kernel launched with PDL does not wait"
