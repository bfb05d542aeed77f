"""``gemm_act``: C = epilogue(A @ W^T + bias) in one kernel, the epilogue applied before the single store.

A is ``[M, K]`` or batched ``[B, S, K]`` with any strides (rows are addressed as ``(m // S, m % S)``,
so a permuted or sliced activation needs no copy). W is packed ``[N, K_pad]`` (see packing.py). Two
ways to move tiles, picked per call: tensor descriptors (TMA on Hopper) when A, W and C are 2-D
addressable with 16-byte aligned rows, else plain masked pointer loads, which take any shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import Problem, TileConfig, matmul_candidates
from .epilogue import NO_EPILOGUE, Epilogue
from .launch import (
    FLOAT32_BIASES,
    KernelCall,
    PlanCache,
    aligned_2d,
    cdiv,
    check_bias,
    check_device,
    check_float,
    check_input_affine,
    check_input_scale,
    check_out,
    check_path,
    check_residual,
    choose_tile,
    descriptors_available,
    dot_precision,
    make_descriptor,
    tensor_meta,
    with_fallback,
)
from .packing import PackedGemmWeight
from .precision import Precision, dot_acc
from .splitk import SplitK, reduces_in_tail, split_k_candidates
from .tiles import (
    decode_rows,
    finish_tile,
    grouped_tile,
    load_operand,
    operand_prologue,
    prologue_code,
    row_offsets,
    split_range,
)


# M and M_INNER vary with the batch and sequence length: not specialized, one compile serves them all.
@triton.jit(do_not_specialize=["M", "M_INNER"])
def _gemm_act_kernel(
    # pointers, or tensor descriptors when USE_DESC (a, w, c); ps_ptr: the prologue's per-(b, k) factors
    # (tiles.py), a [B, K] tensor; ws_ptr and count_ptr, when SPLIT_K > 1: the float32 [SPLIT_K, M, N]
    # workspace and the tiles' int32 arrival counters (tiles.finish_tile)
    a_ref,
    w_ref,
    bias_ptr,
    res_ptr,
    c_ref,
    ps_ptr,
    ws_ptr,
    count_ptr,
    # sizes
    M,
    N,
    K,
    M_INNER,
    # strides (elements)
    stride_ab,
    stride_am,
    stride_ak,
    stride_wn,
    stride_rb,
    stride_rm,
    stride_rn,
    stride_cm,
    stride_psb,
    stride_psk,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    PROLOGUE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_DESC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    k_lo, k_hi = split_range(K, split, BLOCK_K, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # A's rows (b, s) are output rows decoded with OH = M_INNER, OW = 1 (see tiles.py)
    b_idx, s_idx, o_idx = decode_rows(offs_m, m_ok, M_INNER, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ps_img = b_idx.to(tl.int64)[:, None] * stride_psb

    if USE_DESC:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = a_ref.load([pid_m * BLOCK_M, k0])
            k_ok = offs_k < k_hi - k0
            a = operand_prologue(a, ps_ptr, ps_img, ((k0 + offs_k) * stride_psk)[None, :],
                                 m_ok[:, None] & k_ok[None, :], PROLOGUE)  # fmt: skip
            w = w_ref.load([pid_n * BLOCK_N, k0])
            acc = dot_acc(a, w.T, acc, DOT_PRECISION, UPCAST)
    else:
        a_rows = row_offsets(b_idx, s_idx, o_idx, stride_ab, stride_am, 0)
        a_ptrs = a_ref + a_rows[:, None] + (k_lo + offs_k)[None, :] * stride_ak
        w_ptrs = w_ref + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = offs_k < k_hi - k0
            a = load_operand(a_ptrs, m_ok[:, None] & k_ok[None, :], ps_ptr, ps_img,
                             ((k0 + offs_k) * stride_psk)[None, :], PROLOGUE)  # fmt: skip
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = dot_acc(a, w, acc, DOT_PRECISION, UPCAST)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K

    res_rows = row_offsets(b_idx, s_idx, o_idx, stride_rb, stride_rm, 0)
    finish_tile(acc, c_ref, ws_ptr, count_ptr, tl.program_id(0), offs_m, offs_n, m_ok, n_ok, pid_m * BLOCK_M,
                pid_n * BLOCK_N, split, M, N, stride_cm,
                bias_ptr, res_ptr, res_rows, stride_rn, alpha, scale, HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32,
                USE_DESC, SPLIT_K, SPLIT_TAIL)  # fmt: skip


INTERPRET_CONFIG = TileConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)


def gemm_candidates(m: int, n: int, k: int, operand_bytes: int) -> list[TileConfig]:
    """The short list of tile configs worth measuring for an ``m x k x n`` problem (first = default),
    small-grid split-K variants included (splitk.py)."""
    bk = 64 if operand_bytes == 2 else 32
    if m <= 32:
        bm = 16 if m <= 16 else 32
        base = [
            TileConfig(bm, 64, 2 * bk, 1, 4, 4),
            TileConfig(bm, 128, 2 * bk, 1, 4, 3),
            TileConfig(bm, 32, 4 * bk, 1, 4, 3),
            TileConfig(bm, 128, bk, 1, 4, 5),
        ]
    else:
        base = matmul_candidates(m, n, k, bk)
    return split_k_candidates(base, m, n, lambda c: cdiv(k, c.block_k))


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, X]`` as a 2-D ``[B * S, X]`` view, or None when the strides do not allow one."""
    b, s, x = t.shape
    if b == 1 or t.stride(0) == s * t.stride(1):
        return t.as_strided((b * s, x), (t.stride(1), t.stride(2)))
    return None


def prepare_gemm(
    op: str,
    a3: torch.Tensor,
    w: torch.Tensor,
    n: int,
    precision: Precision,
    bias32: torch.Tensor | None,
    epilogue: Epilogue,
    res3: torch.Tensor | None,
    out2: torch.Tensor,
    interpret: bool,
    path: str,
    tile: TileConfig | None = None,
    scale2: torch.Tensor | None = None,
    affine_act: int | None = None,
) -> Callable[..., Any]:
    """Choose the path and the tile for checked example inputs and return
    ``run(a3, w, bias32, res3, out2, scale2=None)``, which launches the kernel on any tensors of the same
    shapes, strides, dtypes and alignment.

    ``a3 [B, S, K]`` has any strides, ``w`` is ``[N, K_pad]``, ``res3 [B, S, N]`` any strides (None
    without a residual), ``out2 [B * S, N]`` unit channel stride and any row stride. ``scale2 [B, K]``
    (any strides, 0 to broadcast) multiplies A's elements as they are loaded: ``(a3 * scale2[:, None]) @
    W^T`` (the channel-scale prologue, tiles.py); with ``affine_act`` (an activation) they are the scales of the
    affine prologue's pairs instead: ``act(a3 * s + t) @ W^T``. The first call measures the tile candidates unless
    ``tile`` forces one.
    """
    b, s, k = a3.shape
    m = b * s
    a2 = _as_rows(a3)
    can_desc = (
        a2 is not None and aligned_2d(a2) and aligned_2d(w) and aligned_2d(out2) and descriptors_available(out2.device)
    )
    if path == "descriptor" and not can_desc:
        raise ValueError(
            f"{op}: the descriptor path needs 16-byte aligned rows for A {tuple(a3.shape)} "
            f"(strides {a3.stride()}), W and C [{m}, {n}] ({a3.dtype}), and a GPU with TMA"
        )
    use_desc = can_desc and path != "pointer"
    a_row_stride = a2.stride(0) if a2 is not None else 0
    res_strides = res3.stride() if res3 is not None else (0, 0, 0)
    scalars = (
        m, n, k, s,
        *a3.stride(),
        w.stride(0),
        *res_strides,
        out2.stride(0),
        *(scale2.stride() if scale2 is not None else (0, 0)),
        float(epilogue.alpha), float(epilogue.scale),
    )  # fmt: skip
    constexprs = {
        "HAS_BIAS": bias32 is not None,
        "ACT": int(epilogue.act),
        "RESIDUAL": int(epilogue.residual),
        "HAS_SCALE": epilogue.scale != 1.0,
        "ROUND_TF32": epilogue.round_tf32,
        "PROLOGUE": prologue_code(scale2, affine_act),
        "DOT_PRECISION": dot_precision(precision, w.dtype),
        "UPCAST": interpret,
        "USE_DESC": use_desc,
    }
    call = KernelCall(_gemm_act_kernel, scalars, constexprs, interpret)
    # The runner outlives this call (with_fallback keeps it): it must not hold the example tensors, which a
    # plan first made inside a compiled forward has from that forward's CUDA-graph pool.
    out_row_stride, device, has_bias = out2.stride(0), out2.device, bias32 is not None

    def runner(config: TileConfig) -> Callable[..., Any]:
        options = call.options(config, SPLIT_TAIL=reduces_in_tail(config))
        grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), config.split_k)
        a_block, w_block = [config.block_m, config.block_k], [config.block_n, config.block_k]
        c_block = [config.block_m, config.block_n]
        split = None
        if config.split_k > 1:
            res_rows = (res_strides[0], res_strides[1], 0, res_strides[2])
            split = SplitK(config, m, n, grid[0], (s, 1), res_rows, out_row_stride, epilogue, has_bias, device,
                           interpret)  # fmt: skip

        def run(
            a3: torch.Tensor, w: torch.Tensor, bias32: Any, res3: Any, out2: torch.Tensor, scale2: Any = None
        ) -> Any:
            if use_desc:
                a_ref = make_descriptor(a3.as_strided((m, k), (a_row_stride, 1)), a_block)
                w_ref = make_descriptor(w, w_block)
            else:
                a_ref, w_ref = a3, w
            c_ref = make_descriptor(out2, c_block) if use_desc else out2
            if split is not None:
                main = lambda ws, counts: call.launch(grid, (a_ref, w_ref, bias32, res3, c_ref, scale2, ws, counts),
                                                      options)  # fmt: skip
                return split(main, bias32, res3, out2)
            return call.launch(grid, (a_ref, w_ref, bias32, res3, c_ref, scale2, None, None), options)

        return run

    key = {
        "m_bucket": triton.next_power_of_2(m),
        "n": n,
        "k": k,
        "a_dtype": str(a3.dtype),
        "w_dtype": str(w.dtype),
        "precision": precision.value,
        "descriptor": use_desc,
    }
    candidates = gemm_candidates(m, n, k, w.element_size())
    config = choose_tile(
        "gemm_act",
        key,
        candidates,
        lambda c: runner(c)(a3, w, bias32, res3, out2, scale2),
        interpret=interpret,
        interpret_config=INTERPRET_CONFIG,
        forced=tile,
        device=out2.device,
        problem=Problem(m, n, k, 1, w.element_size(), precision.value),
    )
    return with_fallback(runner, config, candidates, forced=tile is not None or interpret)


_plans = PlanCache()


def gemm_act(
    a: torch.Tensor,
    weight: PackedGemmWeight,
    bias: torch.Tensor | None = None,
    *,
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    interpret: bool = False,
    path: str = "auto",
    tile: TileConfig | None = None,
    input_scale: torch.Tensor | None = None,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
) -> torch.Tensor:
    """``epilogue(a @ W^T + bias)`` for ``a`` of shape ``[..., K]`` (2-D or 3-D, any strides).

    The dot runs in ``weight.precision`` (activations are cast to its operand dtype as they are
    loaded, accumulation is float32); the result has ``a``'s dtype and shape ``[..., N]``.
    ``residual`` broadcasts to the output. ``out`` is written instead of a new tensor when given: the
    output's shape and dtype, unit stride along N, rows of one stride (a column slice of a wider
    buffer is fine). ``interpret=True`` runs the same kernel in Triton's interpreter on CPU tensors.
    ``path`` forces the tensor-descriptor or the pointer path and ``tile`` a tile config (tests).
    ``input_scale`` ``[B or 1, K]`` (``B = a.shape[0]`` for a 3-D ``a``, 1 for a 2-D one) computes
    ``(a * input_scale[:, None]) @ W^T`` instead, the product formed as A is loaded, never stored.
    ``input_affine`` ``[K, 2]`` (float32 columns scale ``s`` and shift ``t``, a BatchNorm's) with ``input_act``
    (an :class:`Activation` without a parameter) computes ``act(a * s + t) @ W^T`` the same way.
    """
    plan = gemm_act_plan(
        a, weight, bias, epilogue=epilogue, residual=residual, out=out, interpret=interpret, path=path, tile=tile,
        input_scale=input_scale, input_affine=input_affine, input_act=input_act,
    )  # fmt: skip
    return plan(a, weight.data, bias, residual, out, input_scale, input_affine)


def gemm_act_plan(
    a: torch.Tensor,
    weight: PackedGemmWeight,
    bias: torch.Tensor | None = None,
    *,
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    interpret: bool = False,
    path: str = "auto",
    tile: TileConfig | None = None,
    input_scale: torch.Tensor | None = None,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
) -> Callable[..., torch.Tensor]:
    """The launch plan of :func:`gemm_act` for calls like this one: ``plan(a, weight.data, bias, residual)``,
    or ``plan(a, weight.data, bias, residual, out)`` for a plan made with an ``out``, and
    ``plan(a, weight.data, bias, residual, out, input_scale, input_affine)`` for one made with an
    ``input_scale`` or an ``input_affine``.

    Valid for any tensors with the same shapes, strides, dtypes, devices and 16-byte alignment as the
    example ones (see :func:`fuser.kernels.conv.conv2d_act_plan`).
    """
    key = lambda: (
        tensor_meta(a), tensor_meta(weight.data), weight.out_features, weight.in_features, weight.precision,
        tensor_meta(bias), tensor_meta(residual), tensor_meta(out), epilogue, interpret, path, tile,
        tensor_meta(input_scale), tensor_meta(input_affine), input_act,
    )  # fmt: skip
    build = lambda: _plan_gemm(
        a, weight, bias, epilogue, residual, out, interpret, path, tile, input_scale, input_affine, input_act
    )
    return _plans.get(key, build)


def _plan_gemm(
    a: torch.Tensor,
    weight: PackedGemmWeight,
    bias: torch.Tensor | None,
    epilogue: Epilogue,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    interpret: bool,
    path: str,
    tile: TileConfig | None,
    input_scale: torch.Tensor | None = None,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
) -> Callable[..., torch.Tensor]:
    """Check one call's inputs (clear errors) and build the plan that serves every call like it."""
    op = "gemm_act"
    if not isinstance(weight, PackedGemmWeight):
        raise TypeError(f"{op}: weight must be a PackedGemmWeight (see pack_gemm_weight), got {type(weight)}")
    if not isinstance(a, torch.Tensor) or a.dim() not in (2, 3):
        shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"{op}: a must be a 2-D [M, K] or 3-D [B, S, K] tensor, got {shape}")
    check_float(op, "a", a)
    check_path(op, path)
    n, k = weight.out_features, weight.in_features
    if a.shape[-1] != k:
        raise ValueError(f"{op}: a has K={a.shape[-1]} (shape {tuple(a.shape)}) but the weight expects K={k}")
    tensors = {"a": a, "weight": weight.data, "bias": bias, "residual": residual, "out": out}
    device = check_device(op, interpret, {**tensors, "input_scale": input_scale, "input_affine": input_affine})
    batch = a.shape[0] if a.dim() == 3 else 1
    a_dtype = a.dtype  # the plan keeps no tensor of the call it was made for (a CUDA-graph pool's, say)
    if input_scale is not None and input_affine is not None:
        raise ValueError(f"{op}: input_scale and input_affine both transform A as it is loaded; give one")
    scale_rows = lambda t: check_input_scale(op, t, batch, k, a_dtype, "a")
    affine_rows = lambda t: check_input_affine(op, t, input_act, batch, k, device)
    scale2 = scale_rows(input_scale) if input_affine is None else affine_rows(input_affine)
    affine_act = None if input_affine is None else input_act
    bias32 = check_bias(op, bias, n)
    convert_bias = bias32 is not None and bias32 is not bias
    float32_bias = FLOAT32_BIASES
    out_shape = (*a.shape[:-1], n)
    dtype = a.dtype
    res = check_residual(op, epilogue, residual, out_shape)
    example = torch.empty(out_shape, dtype=dtype, device=device) if out is None else out
    out_rows = check_out(op, example, out_shape, dtype, device, len(out_shape) - 1)
    rows_shape, rows_stride = tuple(out_rows.shape), out_rows.stride()
    rows = lambda t: t.as_strided(rows_shape, rows_stride)
    if example.numel() == 0:
        return lambda a, w, bias, residual, out=None, input_scale=None, input_affine=None: (
            torch.empty(out_shape, dtype=dtype, device=device) if out is None else out
        )
    to3 = (lambda t: t) if a.dim() == 3 else (lambda t: t.unsqueeze(0))
    res3 = None if res is None else to3(res)
    run = prepare_gemm(op, to3(a), weight.data, n, weight.precision, bias32, epilogue, res3, out_rows,
                       interpret, path, tile, scale2, affine_act)  # fmt: skip

    def plan(
        a: torch.Tensor,
        w: torch.Tensor,
        bias: Any,
        residual: Any,
        out: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        input_affine: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(out_shape, dtype=dtype, device=device)
        res3 = None if residual is None else to3(residual.expand(out_shape))
        if input_affine is not None:
            scale2 = affine_rows(input_affine)
        else:
            scale2 = None if input_scale is None else scale_rows(input_scale)
        run(to3(a), w, float32_bias(bias) if convert_bias else bias, res3, rows(out), scale2)
        return out

    return plan
