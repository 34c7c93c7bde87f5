"""ShortConv (LFM2's double-gated causal depthwise convolution ``y = C * conv(B * x)``): prefill,
verify with a tape, commit, decode.

The prefill and verify ops take the whole ``in_proj`` output ``bcx [B, T, 3H]`` (HF chunk order:
B gate = channels ``[0, H)``, C gate = ``[H, 2H)``, x = ``[2H, 3H)``) and apply both gates inside
the conv kernel, so neither gate multiply is a kernel of its own (two fewer kernels per ShortConv
layer per forward). They return ``y [B, T, H]``, the input of ``out_proj``.

Layouts (time-major, so each token's channels are contiguous):
- ``weight [H, K]``: tap ``K-1`` weights the current token, tap 0 the oldest (HF ``conv.weight``
  squeezed);
- ``conv_state [n_conv_layers, slots, K-1, H]``: the last ``K-1`` gated inputs ``Bx`` of each slot,
  oldest first;
- ``tape [n_conv_layers, rows, >= W+K-1, H]``: per batch row, ``[state ; Bx of the W block tokens]`` in its
  first ``W+K-1`` columns (a tape allocated for a wider block serves narrower ones).
  The state after accepting ``c`` block tokens (``0 <= c <= W``) is ``tape[:, row, c:c+K-1]``, so one
  deduplicated window serves every accepted length (reference/sglang.md §3.3).

Numerics, each step rounded once to ``bcx``'s dtype exactly as the unfused composition
``bx = b * x; z = conv(bx); y = c * z`` in that dtype: ``Bx = B * x`` (an fp32 product of two
bf16/fp16 values is exact, so rounding it equals torch's multiply in that dtype);
``z[t] = sum_j weight[:, j] * x_ext[t + j]`` with ``x_ext = [initial state ; Bx]``, accumulated in
fp32 in tap order without FMA contraction; ``y = C * z``. So the kernels equal the reference bit for
bit. Rows whose slot is ``-1`` are skipped (their outputs are zero).
Tape rows are indexed by batch row, the state by slot (DESIGN §1 pitfalls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _ext_load(bcx_row, st_row, i, stride_bt, stride_st, H, cols, cmask, KM1: tl.constexpr, ZERO_INIT):
    """Column ``i`` of ``x_ext = [initial state ; Bx]`` as fp32 (``ZERO_INIT``: the state is zeros).

    ``Bx = B * x`` is rounded to ``bcx``'s dtype, as a separate multiply in that dtype would."""
    # (scalar conditions enter masks through tl.where: `vector & scalar` breaks the interpreter)
    from_state = i < KM1
    s = tl.load(st_row + i * stride_st + cols, mask=tl.where(from_state & (ZERO_INIT == 0), cmask, False), other=0.0)
    xmask = tl.where(from_state, False, cmask)
    tok = bcx_row + (i - KM1) * stride_bt
    bg = tl.load(tok + cols, mask=xmask, other=0.0)
    x = tl.load(tok + 2 * H + cols, mask=xmask, other=0.0)
    bx = (bg.to(tl.float32) * x.to(tl.float32)).to(bg.dtype)
    return tl.where(from_state, s.to(tl.float32), bx.to(tl.float32))


@triton.jit
def _short_conv_prefill_kernel(
    bcx_ptr, w_ptr, state_ptr, out_ptr, slots_ptr, start_ptr, lens_ptr,
    T, H,
    stride_bb, stride_bt, stride_ob, stride_ot,
    stride_ss, stride_st,
    K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row, channel block, time block): the outputs are independent across time, so long
    # prompts spread over many programs instead of one sequential scan per channel block
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t0 = tl.program_id(2) * BLOCK_T
    slot = tl.load(slots_ptr + b)
    cmask = tl.where(slot >= 0, cols < H, False)
    zero_init = (tl.load(start_ptr + b) == 0).to(tl.int32)
    n = tl.load(lens_ptr + b)
    bcx_row = bcx_ptr + b.to(tl.int64) * stride_bb
    st_row = state_ptr + slot.to(tl.int64) * stride_ss
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    for t in range(t0, tl.minimum(t0 + BLOCK_T, T)):
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += w * _ext_load(bcx_row, st_row, t + j, stride_bt, stride_st, H, cols, cmask, K - 1, zero_init)
        z = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(bcx_row + t * stride_bt + H + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_row + t * stride_ot + cols, (c * z).to(out_ptr.dtype.element_ty), mask=cols < H)
    # new state = x_ext[n : n + K-1], written by the first time block only: it is the only block
    # that reads the old state (t + j < K - 1 needs t < K - 1 <= BLOCK_T), and it has read it by now.
    # Column i reads x_ext[n + i] with n + i >= i, so writing in increasing i never overwrites a
    # state column that is still to be read.
    if t0 == 0:
        for i in tl.static_range(K - 1):
            x = _ext_load(bcx_row, st_row, n + i, stride_bt, stride_st, H, cols, cmask, K - 1, zero_init)
            tl.store(st_row + i * stride_st + cols, x.to(state_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _short_conv_verify_kernel(
    bcx_ptr, w_ptr, state_ptr, tape_ptr, out_ptr, slots_ptr,
    H,
    stride_bb, stride_bt, stride_ob, stride_ot,
    stride_ss, stride_st,
    stride_tr, stride_tt,
    K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row, channel block, block token t): output t, and tape column t + K - 1 (token t's
    # Bx, which its last tap reads anyway); token 0's program also copies the state into columns
    # 0 .. K-2. Parallel over the block's tokens: a sequential scan leaves 8 programs per row doing
    # ~50 dependent loads each (7.7 us per layer at batch 1).
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = tl.program_id(2)
    slot = tl.load(slots_ptr + b)
    cmask = tl.where(slot >= 0, cols < H, False)
    bcx_row = bcx_ptr + b.to(tl.int64) * stride_bb
    st_row = state_ptr + slot.to(tl.int64) * stride_ss
    tape_row = tape_ptr + b.to(tl.int64) * stride_tr
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
        x = _ext_load(bcx_row, st_row, t + j, stride_bt, stride_st, H, cols, cmask, K - 1, 0)
        acc += w * x
        if j == K - 1:
            tl.store(tape_row + (t + j) * stride_tt + cols, x.to(tape_ptr.dtype.element_ty), mask=cmask)
    z = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(bcx_row + t * stride_bt + H + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_row + t * stride_ot + cols, (c * z).to(out_ptr.dtype.element_ty), mask=cols < H)
    if t == 0:
        for i in tl.static_range(K - 1):
            x = _ext_load(bcx_row, st_row, i, stride_bt, stride_st, H, cols, cmask, K - 1, 0)
            tl.store(tape_row + i * stride_tt + cols, x.to(tape_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _short_conv_commit_kernel(
    state_ptr, tape_ptr, slots_ptr, acc_ptr,
    H,
    stride_sl, stride_ss, stride_st,
    stride_tl, stride_tr, stride_tt,
    KM1: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    layer = tl.program_id(0)
    b = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slots_ptr + b)
    c = tl.load(acc_ptr + b)
    cmask = tl.where(slot >= 0, cols < H, False)
    layer = layer.to(tl.int64)
    src = tape_ptr + layer * stride_tl + b.to(tl.int64) * stride_tr + c * stride_tt
    dst = state_ptr + layer * stride_sl + slot.to(tl.int64) * stride_ss
    for i in tl.static_range(KM1):
        x = tl.load(src + i * stride_tt + cols, mask=cmask)
        tl.store(dst + i * stride_st + cols, x, mask=cmask)


# ---------------------------------------------------------------------------------------------
# launchers

_BLOCK_H = 256
_BLOCK_T = 16      # prefill tokens per program (>= K - 1, see the prefill kernel)
MAX_CONV_WIDTH = _BLOCK_T + 1   # the widest conv kernel (conv_L_cache) the prefill kernel takes


def _check_inner(x: torch.Tensor, name: str) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (channel) dimension")


def _split_shape(bcx: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """``(B, T, H)`` of ``bcx [B, T, 3H]`` after checking it against ``weight [H, K]``."""
    if bcx.dim() != 3:
        raise ValueError(f"bcx must be [B, T, 3H] (the in_proj output), got shape {tuple(bcx.shape)}")
    B, T, H3 = bcx.shape
    if H3 % 3 != 0:
        raise ValueError(f"bcx's last dimension ({H3}) must be 3 * H: the B gate, C gate and x chunks")
    H = H3 // 3
    if weight.dim() != 2 or weight.shape[0] != H:
        raise ValueError(f"weight must be [H, K] with H = bcx.shape[-1] / 3 = {H}, got shape {tuple(weight.shape)}")
    return B, T, H


def short_conv_prefill_triton(bcx, weight, conv_state, layer, slots, start, lens) -> torch.Tensor:
    B, T, H = _split_shape(bcx, weight)
    K = weight.shape[1]
    if K > MAX_CONV_WIDTH:
        raise ValueError(f"conv kernel width {K} exceeds what the prefill kernel supports ({MAX_CONV_WIDTH})")
    bcx = bcx if bcx.stride(-1) == 1 else bcx.contiguous()
    out = bcx.new_empty((B, T, H))     # every element is stored
    if B * T == 0:
        return out
    _check_inner(conv_state, "conv_state")
    grid = (B, triton.cdiv(H, _BLOCK_H), triton.cdiv(T, _BLOCK_T))
    state = conv_state[layer]          # the layer's view (no 32-bit layer * stride in the kernel)
    _short_conv_prefill_kernel[grid](
        bcx, weight.contiguous(), state, out, slots, start, lens,
        T, H,
        bcx.stride(0), bcx.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1),
        K=K, BLOCK_H=_BLOCK_H, BLOCK_T=_BLOCK_T, enable_fp_fusion=False, **pdl_kwargs(bcx),
    )
    return out


def short_conv_verify_triton(bcx, weight, conv_state, tape, layer, slots) -> torch.Tensor:
    B, W, H = _split_shape(bcx, weight)
    bcx = bcx if bcx.stride(-1) == 1 else bcx.contiguous()
    out = bcx.new_empty((B, W, H))     # every element is stored
    if B * W == 0:
        return out
    _check_inner(conv_state, "conv_state")
    _check_inner(tape, "tape")
    grid = (B, triton.cdiv(H, _BLOCK_H), W)
    state, tape_l = conv_state[layer], tape[layer]
    _short_conv_verify_kernel[grid](
        bcx, weight.contiguous(), state, tape_l, out, slots,
        H,
        bcx.stride(0), bcx.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1),
        tape_l.stride(0), tape_l.stride(1),
        K=weight.shape[1], BLOCK_H=_BLOCK_H, enable_fp_fusion=False, **pdl_kwargs(bcx),
    )
    return out


def short_conv_commit_triton(conv_state, tape, slots, accepted) -> None:
    n_layers, _, km1, H = conv_state.shape
    B = slots.shape[0]
    if B == 0 or n_layers == 0:
        return
    grid = (n_layers, B, triton.cdiv(H, _BLOCK_H))
    _short_conv_commit_kernel[grid](
        conv_state, tape, slots, accepted,
        H,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        tape.stride(0), tape.stride(1), tape.stride(2),
        KM1=km1, BLOCK_H=_BLOCK_H, **pdl_kwargs(conv_state),
    )


# ---------------------------------------------------------------------------------------------
# references

def _conv_windows(x_ext: torch.Tensor, weight: torch.Tensor, T: int) -> torch.Tensor:
    """``z[b, t] = sum_j weight[:, j] * x_ext[b, t + j]`` in fp32; ``x_ext [B, T+K-1, H]``."""
    K = weight.shape[1]
    w = weight.float()
    return sum(w[:, j] * x_ext[:, j:j + T].float() for j in range(K))


def _gates(bcx: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Bx, C)``: the gated conv input ``B * x`` (one multiply in ``bcx``'s dtype) and the C gate."""
    _split_shape(bcx, weight)
    b_gate, c_gate, x = bcx.chunk(3, dim=-1)
    return b_gate * x, c_gate


def short_conv_prefill_reference(bcx, weight, conv_state, layer, slots, start, lens) -> torch.Tensor:
    bx, c_gate = _gates(bcx, weight)
    B, T, H = bx.shape
    K = weight.shape[1]
    real = slots >= 0
    init = conv_state[layer, slots.clamp(min=0)].to(bx.dtype)
    init = torch.where((start > 0)[:, None, None], init, torch.zeros_like(init))
    x_ext = torch.cat([init, bx], dim=1)
    z = _conv_windows(x_ext, weight, T).to(bx.dtype)
    out = torch.where(real[:, None, None], c_gate * z, torch.zeros_like(z))
    idx = lens[:, None] + torch.arange(K - 1, device=bx.device)[None, :]
    new_state = torch.gather(x_ext, 1, idx[:, :, None].expand(-1, -1, H))
    for b, slot in enumerate(slots.tolist()):     # one copy per real row (no masked gather and scatter)
        if slot >= 0:
            conv_state[layer, slot] = new_state[b].to(conv_state.dtype)
    return out


def short_conv_verify_reference(bcx, weight, conv_state, tape, layer, slots) -> torch.Tensor:
    bx, c_gate = _gates(bcx, weight)
    W = bx.shape[1]
    real = slots >= 0
    x_ext = torch.cat([conv_state[layer, slots.clamp(min=0)].to(bx.dtype), bx], dim=1)
    rows = real.nonzero().flatten()
    tape[layer, rows, :x_ext.shape[1]] = x_ext[rows].to(tape.dtype)   # a wider tape keeps its extra columns
    z = _conv_windows(x_ext, weight, W).to(bx.dtype)
    return torch.where(real[:, None, None], c_gate * z, torch.zeros_like(z))


def short_conv_commit_reference(conv_state, tape, slots, accepted) -> None:
    km1 = conv_state.shape[2]
    rows = (slots >= 0).nonzero().flatten()
    for r in rows.tolist():
        c = int(accepted[r])
        conv_state[:, slots[r]] = tape[:, r, c:c + km1]


# ---------------------------------------------------------------------------------------------
# ops

@torch.library.custom_op("lfmspark::short_conv_prefill", mutates_args=("conv_state",))
def short_conv_prefill(bcx: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, layer: int,
                       slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``y = C * conv(B * x)`` for the in_proj output ``bcx [B, T, 3H]`` (first ``lens[b]`` tokens
    real), continuing each slot's state, then store the window of ``Bx`` after the last real token.
    Returns ``y [B, T, H]``. A row with ``start == 0`` starts from zeros, so a fresh slot needs no
    reset; ``T == 1`` is the decode step."""
    if use_triton(bcx):
        return short_conv_prefill_triton(bcx, weight, conv_state, layer, slots, start, lens)
    return short_conv_prefill_reference(bcx, weight, conv_state, layer, slots, start, lens)


@short_conv_prefill.register_kernel("cuda")
def _prefill_cuda(bcx, weight, conv_state, layer, slots, start, lens):
    return short_conv_prefill_triton(bcx, weight, conv_state, layer, slots, start, lens)


@short_conv_prefill.register_fake
def _prefill_fake(bcx, weight, conv_state, layer, slots, start, lens):
    return bcx.new_empty(_split_shape(bcx, weight))


@torch.library.custom_op("lfmspark::short_conv_verify", mutates_args=("tape",))
def short_conv_verify(bcx: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, tape: torch.Tensor,
                      layer: int, slots: torch.Tensor) -> torch.Tensor:
    """``y = C * conv(B * x)`` for a verify block's in_proj output ``bcx [B, W, 3H]``, from the
    committed state without changing it; records ``[state ; Bx]`` in ``tape[layer, b]`` for
    :func:`short_conv_commit`. Returns ``y [B, W, H]``."""
    if use_triton(bcx):
        return short_conv_verify_triton(bcx, weight, conv_state, tape, layer, slots)
    return short_conv_verify_reference(bcx, weight, conv_state, tape, layer, slots)


@short_conv_verify.register_kernel("cuda")
def _verify_cuda(bcx, weight, conv_state, tape, layer, slots):
    return short_conv_verify_triton(bcx, weight, conv_state, tape, layer, slots)


@short_conv_verify.register_fake
def _verify_fake(bcx, weight, conv_state, tape, layer, slots):
    return bcx.new_empty(_split_shape(bcx, weight))


@torch.library.custom_op("lfmspark::short_conv_commit", mutates_args=("conv_state",))
def short_conv_commit(conv_state: torch.Tensor, tape: torch.Tensor, slots: torch.Tensor,
                      accepted: torch.Tensor) -> None:
    """For every conv layer: ``conv_state[l, slots[b]] = tape[l, b, accepted[b] : accepted[b]+K-1]``
    (the window after ``accepted[b]`` block tokens, ``0 <= accepted <= W``)."""
    if use_triton(conv_state):
        short_conv_commit_triton(conv_state, tape, slots, accepted)
    else:
        short_conv_commit_reference(conv_state, tape, slots, accepted)


@short_conv_commit.register_kernel("cuda")
def _commit_cuda(conv_state, tape, slots, accepted) -> None:
    short_conv_commit_triton(conv_state, tape, slots, accepted)


@short_conv_commit.register_fake
def _commit_fake(conv_state, tape, slots, accepted) -> None:
    return None
