"""Compile the weight-streaming (exact mode's too), MoE expert, Markov-walk and sampling-threshold kernels for sm_90 (Hopper)
with the installed Triton, on a machine without a GPU: front end, layout passes and PTX, in each variant the
round uses.

Why: the interpreter runs none of Triton's compiler passes, and the device's Triton (3.6) rejects
code that a newer one accepts (3.6's layout pass crashes on a 16 x 16 lane select in a while loop;
its front end rejects a str default of a constexpr parameter), which otherwise shows only on the
device. A venv with the device's Triton (``pip install --no-deps triton==3.6.0`` beside the
CPU torch) catches both here:

    python scripts/compile_sm90.py        # prints one line per compiled variant, raises on the first failure
"""

from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lfmspark.ops.exact_norm import _exact_rms_norm_kernel
from lfmspark.ops.linear.add_rmsnorm_gemv import _add_rmsnorm_gemv_kernel
from lfmspark.ops.linear.exact_linear import _exact_linear_kernel
from lfmspark.ops.markov_walk.jacobi import _markov_walk_jacobi_kernel
from lfmspark.ops.markov_walk.persistent import _markov_walk_persistent_kernel, resident_blocks
from lfmspark.ops.moe import _moe_down_kernel, _moe_gate_up_kernel, moe_config
from lfmspark.ops.linear.skinny_linear import _gemv_kernel, _skinny_linear_kernel
from lfmspark.ops import threshold_filter as tf

# pointer parameters by name (every other pointer: bf16)
INT_PTRS = {"cnt_ptr": "*i32", "pi_ptr": "*i32", "sync_ptr": "*i32", "anchor_ptr": "*i64",
            "tok_ptr": "*i64", "stats_ptr": "*i64"}
F32_PTRS = {"ws_ptr", "pv_ptr", "ssq_out_ptr", "ssq_in_ptr"}


def compile_one(kernel, const: dict, num_warps: int = 4, num_stages: int = 2, types: dict[str, str] | None = None
                ) -> None:
    """Compile ``kernel`` with the constexprs ``const``; its other parameters typed by ``types``, else by name."""
    sig = {}
    for n in inspect.signature(kernel.fn).parameters:
        if n in const:
            continue
        if types and n in types:
            sig[n] = types[n]
        elif n.endswith("_ptr"):
            sig[n] = INT_PTRS.get(n, "*fp32" if n in F32_PTRS else "*bf16")
        elif n in ("eps", "inv_k"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    # what the JIT sees on the device at the LFM2 shapes: 16-byte aligned pointers, strides and N, K
    # divisible by 16 (without them loads are not vectorised or pipelined through shared memory, and
    # its size is understated)
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if n.endswith("_ptr") or n.startswith("stride_") or n in ("N", "K")}
    k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    shown = ("SPLIT", "SWIGLU", "TWO_WEIGHTS", "ADD_NORM", "RESIDENT", "COUNT_PASSES", "ROW_TILES", "HAS_DELTA",
             "W_SCALE", "BLOCK_M")
    mma = "wgmma" if "wgmma" in k.asm["ptx"] else "mma.sync" if "mma.sync" in k.asm["ptx"] else "no MMA"
    print(kernel.fn.__name__, {key: v for key, v in const.items() if key in shown}, f"stages {num_stages}",
          "shared memory", k.metadata.shared, mma)


def main() -> None:
    print(f"Triton {triton.__version__}, target sm_90")
    for split in (False, True):
        compile_one(_gemv_kernel, dict(BLOCK_N=4, BLOCK_K=2048, EVEN_K=True, SPLIT=split, W_SCALE=False, PDL=2))
    for swiglu in (False, True):
        compile_one(_add_rmsnorm_gemv_kernel, dict(HAS_DELTA=True, SWIGLU=swiglu, SCALE_LAST=True, BLOCK_N=4, BLOCK_K=2048,
                                                   EVEN_K=True, PDL=2))
    for split in (False, True):
        for sw in (False, True):
            compile_one(_skinny_linear_kernel, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, SPLIT=split,
                                                    SWIGLU=sw, TWO_WEIGHTS=False, ADD_NORM=False, ROW_NORM=True, SSQ_TILES=32,
                                                    W_SCALE=False, DOT_PRECISION="tf32", UPCAST=False, PDL=1),
                        num_stages=4)
    compile_one(_skinny_linear_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, SPLIT=True,
                                            SWIGLU=False, TWO_WEIGHTS=True, ADD_NORM=False, ROW_NORM=False, SSQ_TILES=2,
                                            W_SCALE=False, DOT_PRECISION="tf32", UPCAST=False, PDL=1))
    compile_one(_skinny_linear_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, SPLIT=True,
                                            SWIGLU=False, TWO_WEIGHTS=False, ADD_NORM=True, ROW_NORM=False, SSQ_TILES=2,
                                            W_SCALE=False, DOT_PRECISION="tf32", UPCAST=False, PDL=1))
    # fp8 weights (lfmspark::skinny_linear_fp8): the same kernels reading float8 e4m3 with per-column scales
    fp8 = {"w_ptr": "*fp8e4nv", "wb_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
    for split in (False, True):
        compile_one(_gemv_kernel, dict(BLOCK_N=4, BLOCK_K=2048, EVEN_K=True, SPLIT=split, W_SCALE=True, PDL=2), types=fp8)
    compile_one(_skinny_linear_kernel, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, SPLIT=False, SWIGLU=False,
                                            TWO_WEIGHTS=False, ADD_NORM=False, ROW_NORM=True, SSQ_TILES=32, W_SCALE=True,
                                            DOT_PRECISION="tf32", UPCAST=False, PDL=1), num_stages=4, types=fp8)
    # the MoE experts' GEMMs at LFM2-8B-A1B's shapes (H 2048, I 1792, 32 experts), decode and prefill tiles,
    # bf16 and fp8 stacks (per-channel scales)
    moe_ints = {"slot_pair_ptr": "*i32", "block_expert_ptr": "*i32", "block_rows_ptr": "*i32", "pair_out_ptr": "*fp32",
                "s13_ptr": "*fp32", "s2_ptr": "*fp32"}
    for pairs in (4, 8192):
        cfg = moe_config(pairs, 32)
        for fp8_stacks in (False, True):
            types = dict(moe_ints, **({"w13_ptr": "*fp8e4nv", "w2_ptr": "*fp8e4nv"} if fp8_stacks else {}))
            common = dict(H=2048, I=1792, BLOCK_M=cfg.block_m, DOT_PRECISION="tf32", UPCAST=False, DOT_ROWWISE=False,
                          W_SCALE=fp8_stacks, PDL=1)
            compile_one(_moe_gate_up_kernel, dict(common, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, types=types)
            compile_one(_moe_down_kernel, dict(common, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, types=types)
    for has_delta in (False, True):   # exact mode's norm, and with the residual add (exact_add_rms_norm)
        compile_one(_exact_rms_norm_kernel, dict(BLOCK=2048, HAS_DELTA=has_delta, PDL=1))
    # exact_config's tiles, one and several row tiles a program, at the depths _stages_that_fit gives an sm_90
    # (and exact_swiglu's: two weight tiles a K step, at most 5 row tiles)
    for swiglu, split, row_tiles, stages in ((False, False, 1, 4), (False, True, 1, 4), (False, False, 3, 4),
                                             (False, True, 5, 4), (False, False, 8, 3), (True, False, 1, 4),
                                             (True, True, 1, 4), (True, True, 3, 3), (True, False, 4, 3),
                                             (True, True, 5, 3), (True, False, 5, 3)):
        compile_one(_exact_linear_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, ROW_TILES=row_tiles, SPLIT=split,
                                               SWIGLU=swiglu, DOT_PRECISION="tf32", UPCAST=False, DOT_ROWWISE=False,
                                               PDL=1),
                    num_stages=stages)
    for resident, count in ((2, False), (2, True), (1, False), (0, False)):
        compile_one(_markov_walk_jacobi_kernel, dict(RANK=256, BLOCK_R=256, BLOCK_L=16, BLOCK_V=128, N_BLOCKS=4,
                                                     RESIDENT=resident, STREAM_FROM=max(resident, 1), BLOCK_P=128,
                                                     ROUND=1, DOT_PRECISION="tf32", UPCAST=False, COUNT_PASSES=count,
                                                     POLL_ASM=True, PDL=True), num_warps=8)
    # the blocks a program streams: a 65,536-token vocabulary (2, one resident) and a 128,000-token one (4, none)
    for n_blocks in (2, 4):
        resident = resident_blocks(n_blocks, 1)
        compile_one(_markov_walk_persistent_kernel, dict(RANK=256, BLOCK_R=256, BLOCK_B=16, BLOCK_V=256, N_BLOCKS=n_blocks,
                                                         RESIDENT=resident, STREAM_FROM=max(resident, 1), BLOCK_P=256,
                                                         ROUND=1, DOT_PRECISION="tf32", UPCAST=False, POLL_ASM=True,
                                                         PDL=True), num_warps=8)
    # the sampling thresholds (ops/threshold_filter.py) at V = 65536, one row: fp32 pointers but the counts'
    threshold_types = {n: "*fp32" for k in (tf._stats_kernel, tf._pivot_pass_kernel, tf._pivot_step_kernel,
                                            tf._round_pass_kernel, tf._round_step_kernel)
                       for n in inspect.signature(k.fn).parameters if n.endswith("_ptr")}
    threshold_types.update(pc_ptr="*i32", tc_ptr="*i32", si_ptr="*i32", rc_ptr="*i32", topk_ptr="*i64")
    npiv, pp = tf._NPIV, tf._PP
    compile_one(tf._stats_kernel, dict(BLOCK_V=1024, SB=512, PDL=1), types=threshold_types)
    compile_one(tf._pivot_pass_kernel, dict(BLOCK_V=1024, TILE=16, NBP=64, NBM=tf._NBM, NVAL=tf._NVAL, PP=pp,
                                            DELTA=tf._DELTA, PDL=1), types=threshold_types)
    compile_one(tf._pivot_step_kernel, dict(NBP=64, NBM=tf._NBM, NVAL=tf._NVAL, PP=pp, DELTA=tf._DELTA, NBC=tf._NBC,
                                            CAP=tf._CAP, NSF=tf._NSF, NSI=tf._NSI, PDL=1), types=threshold_types)
    compile_one(tf._round_pass_kernel, dict(BLOCK_V=1024, TILE=32, NPIV=npiv, CAP=tf._CAP, NSF=tf._NSF, NSI=tf._NSI,
                                            PDL=1), types=threshold_types)
    for final in (False, True):
        compile_one(tf._round_step_kernel, dict(PP=pp, NPIV=npiv, CAP=tf._CAP, NBC=tf._NBC, NBP=64, CH=tf._RANK_CHUNK,
                                                FINAL=final, FALLBACK=tf._fallback_rounds(npiv), FTILE=128,
                                                NSF=tf._NSF, NSI=tf._NSI, PDL=1), types=threshold_types)


if __name__ == "__main__":
    main()
