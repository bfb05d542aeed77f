"""The ``@triton.jit`` pieces every fused kernel shares: tile order, output-pixel decode, the reduction
range of one split, the operand prologue (what the A operand's load applies before the dot), and the
epilogue tail (bias, residual, activation, masked store).

A kernel is its main loop plus these. Sharing them means a fix to, say, residual addressing reaches the
implicit GEMM, the GEMM, the direct and depthwise convs and the split-K reduction at once, and a new
kernel variant is its loop, not a copy of the rest.

Output rows are GEMM rows: ``m = (image, oh, ow)`` flattened for a conv. A GEMM's batched rows
``(b, s)`` are the same decode with ``OH = S`` and ``OW = 1`` (Triton specializes an integer argument
equal to 1, so the extra division folds away).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .epilogue import apply_activation, apply_epilogue, round_tf32_tile


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` in grouped order: ``GROUP_M`` consecutive programs share a
    column tile of the weights, so it is read from L2 rather than memory."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_in_group) % group_size_m
    pid_n = (pid % pids_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def decode_rows(offs_m, m_ok, OH, OW):
    """Output rows -> ``(image, oh, ow)``. Rows past the end (``~m_ok``) decode as row 0, so every
    address built from them stays inside the tensors; their results are masked at the store."""
    rows = tl.where(m_ok, offs_m, 0)
    ohw = OH * OW
    return rows // ohw, (rows % ohw) // OW, rows % OW


@triton.jit
def row_offsets(n_idx, oh, ow, s_n, s_h, s_w):
    """Element offsets (int64) of decoded rows in a tensor with strides ``(s_n, s_h, s_w)``."""
    return n_idx.to(tl.int64) * s_n + oh.to(tl.int64) * s_h + ow.to(tl.int64) * s_w


@triton.jit
def split_range(total, split, STEP: tl.constexpr, SPLIT_K: tl.constexpr):
    """``[lo, hi)`` of a reduction of length ``total`` walked in steps of ``STEP`` that split ``split``
    of ``SPLIT_K`` owns: whole steps, the last split taking what is left (possibly nothing)."""
    if SPLIT_K == 1:
        lo = 0
        hi = total
    else:
        per = tl.cdiv(tl.cdiv(total, STEP), SPLIT_K) * STEP
        lo = split * per
        hi = tl.minimum(lo + per, total)
    return lo, hi


# The A operand's prologue, a constexpr of the GEMM-style kernels. CHANNEL_SCALE: every element of A is
# multiplied by a factor per (image, input channel) as it is loaded: ``conv(x * s)`` for the squeeze-excitation
# scale ``s [N, C, 1, 1]``, which then never becomes a tensor of x's size. AFFINE + act (an Activation's value
# added to PROLOGUE_AFFINE): every element becomes ``act(x * s[c] + t[c])``, a BatchNorm and its activation
# applied as the conv loads its input (DenseNet's BN -> ReLU -> conv); the factors are pairs ``(s, t)``
# interleaved per channel, the shift one element after the scale.
PROLOGUE_NONE = tl.constexpr(0)
PROLOGUE_CHANNEL_SCALE = tl.constexpr(1)
PROLOGUE_AFFINE = tl.constexpr(16)


def prologue_code(factors: object, affine_act: int | None) -> int:
    """The ``PROLOGUE`` constexpr of a launch: NONE without ``factors``, AFFINE + ``affine_act`` (an
    :class:`Activation` value) where the factors are an affine prologue's pairs, else CHANNEL_SCALE."""
    if factors is None:
        return int(PROLOGUE_NONE)
    if affine_act is None:
        return int(PROLOGUE_CHANNEL_SCALE)
    return int(PROLOGUE_AFFINE) + int(affine_act)


@triton.jit
def operand_prologue(a, ps_ptr, ps_img, ps_chan, mask, PROLOGUE: tl.constexpr):
    """Tile ``a`` of the A operand after its prologue. CHANNEL_SCALE: times the factors at
    ``ps_ptr + ps_img + ps_chan`` (offsets of the image and of the channel, broadcast to ``a``'s shape),
    multiplied in float32 and rounded back to ``a``'s dtype: what ``x * s`` in ``x``'s dtype gives.
    AFFINE + act: ``act(a * s + t)`` in float32 with ``s`` there and ``t`` one element after it, rounded back
    to ``a``'s dtype; outside ``mask`` (a conv's padding, rows and channels past the end) it stays exactly 0,
    as the padding of a conv is applied to its input after the activation."""
    if PROLOGUE == PROLOGUE_CHANNEL_SCALE:
        s = tl.load(ps_ptr + ps_img + ps_chan, mask=mask, other=0.0)
        a = (a.to(tl.float32) * s.to(tl.float32)).to(a.dtype)
    elif PROLOGUE >= PROLOGUE_AFFINE:
        s = tl.load(ps_ptr + ps_img + ps_chan, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(ps_ptr + ps_img + ps_chan + 1, mask=mask, other=0.0).to(tl.float32)
        y = apply_activation(a.to(tl.float32) * s + t, 0.0, PROLOGUE - PROLOGUE_AFFINE)
        a = tl.where(mask, y, 0.0).to(a.dtype)
    return a


@triton.jit
def load_operand(ptrs, mask, ps_ptr, ps_img, ps_chan, PROLOGUE: tl.constexpr):
    """A masked load of an A tile (zeros outside ``mask``) and its :func:`operand_prologue`."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    return operand_prologue(a, ps_ptr, ps_img, ps_chan, mask, PROLOGUE)


@triton.jit
def virtual_cat_pointers(
    a_ptr, b_ptr, n_idx, ih, iw, c, c0, C_A, sa_n, sa_h, sa_w, sa_c, sb_n, sb_h, sb_w, sb_c, UP: tl.constexpr
):
    """Addresses of an A tile (rows at input pixels ``(n_idx, ih, iw)``, channels ``c`` of one block starting
    at ``c0``) in the virtual input ``cat([upsample_nearest(a, UP), b], 1)``, which is never materialized:
    channels below ``C_A`` are ``a``'s at ``(ih // UP, iw // UP)``, the rest ``b``'s at ``(ih, iw)``. A block
    lies in one source when ``C_A`` is a multiple of the block (the launcher's condition)."""
    n64 = n_idx.to(tl.int64)
    if c0 < C_A:
        rows = n64 * sa_n + (ih // UP).to(tl.int64) * sa_h + (iw // UP).to(tl.int64) * sa_w
        ptrs = a_ptr + rows[:, None] + (c.to(tl.int64) * sa_c)[None, :]
    else:
        rows = n64 * sb_n + ih.to(tl.int64) * sb_h + iw.to(tl.int64) * sb_w
        ptrs = b_ptr + rows[:, None] + ((c - C_A).to(tl.int64) * sb_c)[None, :]
    return ptrs


@triton.jit
def epilogue_tile(
    acc,
    channels,
    n_ok,
    m_ok,
    bias_ptr,
    res_ptr,
    res_rows,
    sr_c,
    alpha,
    scale,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
):
    """The fused epilogue of a float32 accumulator tile ``[rows, channels]``: bias (float32, per
    channel), residual (rows at ``res_rows``, channels ``sr_c`` apart), activation, scale; with
    ``ROUND_TF32`` the result rounded to nearest TF32 (:func:`round_tf32_tile`) for a store that only
    TF32 dots read."""
    if HAS_BIAS:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
        bias = tl.load(bias_ptr + channels, mask=n_ok, other=0.0)[None, :]
    else:
        bias = 0.0
    if RESIDUAL != 0:
        res_ptrs = res_ptr + res_rows[:, None] + channels[None, :].to(tl.int64) * sr_c
        res = tl.load(res_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    else:
        res = 0.0
    y = apply_epilogue(acc, bias, res, alpha, scale, ACT, RESIDUAL, HAS_SCALE)
    if ROUND_TF32:
        y = round_tf32_tile(y)
    return y


@triton.jit
def store_tile(out_ptr, offs_m, stride_om, channels, m_ok, n_ok, y):
    """Masked store of tile ``y`` into rows ``offs_m`` (``stride_om`` apart) and unit-stride ``channels``
    of ``out_ptr``, cast to its dtype. A row stride above the channel count is a channel slice of a
    wider buffer; the mask keeps every store inside the slice."""
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + channels[None, :]
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def sum_splits(ws_ptr, offs_m, M, ws_row_stride, channels, m_ok, n_ok, SPLITS):
    """The ``SPLITS`` partial tiles of a split tile, rows ``split * M + m`` of the float32 workspace,
    added in split order 0, 1, ..., SPLITS-1: the same bits whichever program adds them (a tile's last
    program, or splitk.py's reduction kernel). ``SPLITS`` is a constexpr for split-K and a runtime count
    for stream-K (conv.py), whose tiles have different numbers of contributors. The loads go to L2
    (``.cg``): the partials were written by other SMs, whose stores an L1 line would not show."""
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = ws_ptr + offs_m[:, None].to(tl.int64) * ws_row_stride + channels[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLITS):
        acc += tl.load(ptrs + s * M.to(tl.int64) * ws_row_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def arrive_and_sum(acc, ws_ptr, count_ptr, tile_id, slot, slots, offs_m, channels, m_ok, n_ok, M, ws_row_stride):
    """One contributor's part of a tile whose reduction ``slots`` programs share: store the partial sum
    ``acc`` to workspace slot ``slot`` (rows ``slot * M + m``), count the arrival on ``count_ptr[tile_id]``;
    the last program to arrive adds the slots in order (:func:`sum_splits`) and sets the counter back to 0
    for the next launch. Returns ``(last, acc)``, ``acc`` the whole sum where ``last``. No program waits
    for another.

    The barrier before the count makes every thread's partial stores precede the release of the
    acquire-release add; the one after it orders the last program's loads after its acquire (the
    pattern of CUTLASS's serial split-K semaphore)."""
    store_tile(ws_ptr, slot * M + offs_m, ws_row_stride, channels, m_ok, n_ok, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = arrived == slots - 1
    if last:
        acc = sum_splits(ws_ptr, offs_m, M, ws_row_stride, channels, m_ok, n_ok, slots)
        tl.atomic_xchg(count_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    return last, acc


@triton.jit
def epilogue_store(
    acc,
    out_ref,
    offs_m,
    channels,
    m_ok,
    n_ok,
    tile_row,
    tile_col,
    stride_om,
    bias_ptr,
    res_ptr,
    res_rows,
    sr_c,
    alpha,
    scale,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    USE_DESC: tl.constexpr,
):
    """The epilogue of a whole accumulator tile, then its store: through the tensor descriptor ``out_ref``
    at ``(tile_row, tile_col)`` when ``USE_DESC``, else masked through pointers."""
    y = epilogue_tile(acc, channels, n_ok, m_ok, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale,
                      HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32)  # fmt: skip
    if USE_DESC:
        out_ref.store([tile_row, tile_col], y.to(out_ref.dtype))
    else:
        store_tile(out_ref, offs_m, stride_om, channels, m_ok, n_ok, y)


@triton.jit
def finish_tile(
    acc,
    out_ref,
    ws_ptr,
    count_ptr,
    tile_id,
    offs_m,
    channels,
    m_ok,
    n_ok,
    tile_row,
    tile_col,
    split,
    M,
    ws_row_stride,
    stride_om,
    bias_ptr,
    res_ptr,
    res_rows,
    sr_c,
    alpha,
    scale,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    USE_DESC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_TAIL: tl.constexpr,
):
    """How a GEMM-style program ends. Whole (``SPLIT_K == 1``): :func:`epilogue_store`. Split: the program
    stores its partial sum to rows ``split * M + m`` of the float32 workspace ``ws_ptr`` (``ws_row_stride``
    apart); with ``SPLIT_TAIL`` it counts its arrival and the tile's last program adds the partials in split
    order and runs the epilogue (:func:`arrive_and_sum`): no second kernel. Without it splitk.py's reduction
    kernel does."""
    if SPLIT_K > 1:
        if SPLIT_TAIL:
            last, acc = arrive_and_sum(acc, ws_ptr, count_ptr, tile_id, split, SPLIT_K, offs_m, channels, m_ok,
                                       n_ok, M, ws_row_stride)  # fmt: skip
        else:
            store_tile(ws_ptr, split * M + offs_m, ws_row_stride, channels, m_ok, n_ok, acc)
            last = False
    else:
        last = True
    if last:
        epilogue_store(acc, out_ref, offs_m, channels, m_ok, n_ok, tile_row, tile_col, stride_om, bias_ptr, res_ptr,
                       res_rows, sr_c, alpha, scale, HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32,
                       USE_DESC)  # fmt: skip
