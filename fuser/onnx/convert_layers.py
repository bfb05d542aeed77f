"""Converters for layers with weights or windows: Conv, ConvTranspose, BatchNormalization, MatMul, Gemm, pooling,
LayerNormalization, ReduceMean, CumSum, Resize, Pad.

These emit the canonical forms the fusion passes match: ``F.conv2d(x, w, b, stride, padding, dilation,
groups)`` and ``F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)`` with their parameters read
through ``get_attr``, ``F.linear`` for a Gemm with a constant weight, ``torch.matmul`` for MatMul.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F

from fuser.onnx.builder import NodeContext
from fuser.onnx.convert_activations import python_scalar
from fuser.onnx.convert_elementwise import as_shape_value
from fuser.onnx.registry import converter

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def torch_pad(begins: list[int], ends: list[int]) -> list[int]:
    """ONNX pads of the trailing dims (begins, ends, first dim first) in F.pad's order (last dim first)."""
    out: list[int] = []
    for b, e in zip(reversed(begins), reversed(ends), strict=True):
        out += [b, e]
    return out


def _window_pads(ctx: NodeContext, kernel: list[int], strides: list[int], dilations: list[int]) -> list[int]:
    """Explicit pads (begins then ends) from ``pads`` or ``auto_pad``.

    SAME padding depends on the input size only when a stride exceeds 1; then the spatial size must be
    static (it is a property of the layer, not of the batch).
    """
    n = len(kernel)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        pads = list(ctx.attr("pads", [0] * 2 * n))
        if len(pads) != 2 * n:
            raise ctx.invalid(f"pads {pads} do not have 2 * {n} entries")
        return pads
    if auto_pad == "VALID":
        return [0] * 2 * n
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ctx.invalid(f"auto_pad={auto_pad!r}")
    spatial = (ctx.static_shape(0) or [None] * (n + 2))[2:]
    begins, ends = [], []
    for i in range(n):
        span = (kernel[i] - 1) * dilations[i] + 1
        if strides[i] == 1:
            total = span - 1
        elif spatial[i] is None:
            raise ctx.unsupported(f"auto_pad={auto_pad} with stride {strides[i]} on a dynamic spatial size")
        else:
            size = spatial[i]
            total = max((math.ceil(size / strides[i]) - 1) * strides[i] + span - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large)
        ends.append(large if auto_pad == "SAME_UPPER" else small)
    return begins + ends


def _spatial_rank(ctx: NodeContext, i: int, what: str) -> int:
    rank = ctx.require_rank(i)
    if rank - 2 not in (1, 2, 3):
        raise ctx.unsupported(f"{what} over {rank - 2} spatial dims")
    return rank - 2


def _conv_window(ctx: NodeContext, what: str) -> tuple[int, list[int], list[int], list[int]]:
    """(spatial rank, kernel, strides, dilations) of a Conv or ConvTranspose node, the kernel from the attribute
    or else the weight's static shape."""
    n = _spatial_rank(ctx, 1, ctx.node.op_type)
    weight_shape = ctx.static_shape(1)
    kernel = list(ctx.attr("kernel_shape", weight_shape[2:] if weight_shape else []))
    if len(kernel) != n or any(k is None for k in kernel):
        raise ctx.unsupported(f"a {what} whose kernel size is not known at import time")
    return n, kernel, list(ctx.attr("strides", [1] * n)), list(ctx.attr("dilations", [1] * n))


@converter("Conv", versions=(1, 11, 22))
def conv(ctx: NodeContext) -> Any:
    x, w, b = ctx.input(0), ctx.input(1), ctx.optional_input(2)
    n, kernel, strides, dilations = _conv_window(ctx, "convolution")
    pads = _window_pads(ctx, kernel, strides, dilations)
    begins, ends = pads[:n], pads[n:]
    if begins == ends:
        padding = tuple(begins)
    else:
        x = ctx.call(F.pad, x, torch_pad(begins, ends))
        padding = (0,) * n
    groups = int(ctx.attr("group", 1))
    return ctx.call(_CONV[n], x, w, b, tuple(strides), padding, tuple(dilations), groups)


def _transpose_pads(
    ctx: NodeContext, n: int, kernel: list[int], strides: list[int], dilations: list[int], output_padding: list[int]
) -> list[int]:
    """ConvTranspose's pads (begins then ends): given, or made from ``output_shape`` or ``auto_pad`` SAME (the total
    is what the full output has beyond the asked size). Where that total is odd, SAME_UPPER crops the larger half
    at the end and SAME_LOWER, or an ``output_shape`` alone, at the beginning, as onnxruntime does (the spec's
    wording of this has changed between versions). Asked sizes need the input's spatial size at import time."""
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    output_shape = ctx.attr("output_shape")
    if output_shape is None and auto_pad in ("NOTSET", "", "VALID"):
        pads = [0] * 2 * n if auto_pad == "VALID" else list(ctx.attr("pads", [0] * 2 * n))
        if len(pads) != 2 * n:
            raise ctx.invalid(f"pads {pads} do not have 2 * {n} entries")
        return pads
    if auto_pad not in ("NOTSET", "", "SAME_UPPER", "SAME_LOWER"):
        raise ctx.invalid(f"auto_pad={auto_pad!r}")
    spatial = (ctx.static_shape(0) or [None] * (n + 2))[2:]
    if any(size is None for size in spatial):
        raise ctx.unsupported("an output_shape or auto_pad=SAME over a spatial size not known at import time")
    if output_shape is not None:
        asked = list(output_shape)[-n:]
    else:
        asked = [size * stride for size, stride in zip(spatial, strides, strict=True)]
    begins, ends = [], []
    for i in range(n):
        full = strides[i] * (spatial[i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
        total = full - asked[i]
        if total < 0:
            raise ctx.unsupported(f"output size {asked[i]} larger than the {full} the transposed convolution gives")
        small, large = total // 2, total - total // 2
        upper = auto_pad == "SAME_UPPER"
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


@converter("ConvTranspose", versions=(1, 11, 22))
def conv_transpose(ctx: NodeContext) -> Any:
    """``F.conv_transpose{1,2,3}d``, with unequal begin and end pads cropped from the output by a slice (torch's
    ``padding`` crops both sides alike). Not fused: it runs as torch runs it; ultralytics' segmentation heads
    upsample their mask prototypes with one."""
    x, w, b = ctx.input(0), ctx.input(1), ctx.optional_input(2)
    n, kernel, strides, dilations = _conv_window(ctx, "transposed convolution")
    output_padding = list(ctx.attr("output_padding", [0] * n))
    pads = _transpose_pads(ctx, n, kernel, strides, dilations, output_padding)
    begins, ends = pads[:n], pads[n:]
    groups = int(ctx.attr("group", 1))
    shared = [min(p, q) for p, q in zip(begins, ends, strict=True)]
    y = ctx.call(_CONV_TRANSPOSE[n], x, w, b, tuple(strides), tuple(shared), tuple(output_padding), groups,
                 tuple(dilations))  # fmt: skip
    if begins == ends:
        return y
    crop = [slice(p - c, -(q - c) or None) for p, q, c in zip(begins, ends, shared, strict=True)]
    return ctx.call(operator.getitem, y, (slice(None), slice(None), *crop))


@converter("BatchNormalization", versions=(9, 14, 15))
def batch_norm(ctx: NodeContext) -> Any:
    """Eval BatchNorm: ``F.batch_norm(training=False)``. In training mode (torch.onnx writes it for
    ``F.batch_norm(w, None, None, training=True)``, the weight standardization of timm's NFNets) the output
    normalizes by its own batch statistics, which is what it computes for a weight, a constant; only the
    running statistics it also outputs have no inference form."""
    x, scale, bias, mean, var = (ctx.input(i) for i in range(5))
    eps = float(ctx.attr("epsilon", 1e-5))
    if ctx.attr("training_mode", 0):  # outputs 1 and 2 are not converted: a graph that reads them is refused
        return ctx.call(F.batch_norm, x, None, None, scale, bias, True, 0.0, eps)
    return ctx.call(F.batch_norm, x, mean, var, scale, bias, False, 0.0, eps)


@converter("MatMul", versions=(9, 13))
def matmul(ctx: NodeContext) -> Any:
    return ctx.call(torch.matmul, ctx.input(0), ctx.input(1))


@converter("Einsum", versions=(12, 28))
def einsum(ctx: NodeContext) -> Any:
    """``torch.einsum`` of the same equation (numpy's syntax in both, ``...`` included; torchvision's MaxViT
    writes its relative-position attention so)."""
    equation = str(ctx.attr("equation")).replace(" ", "")
    return ctx.call(torch.einsum, equation, *(ctx.input(i) for i in range(ctx.num_inputs)))


@converter("Gemm", versions=(7, 9, 11, 13))
def gemm(ctx: NodeContext) -> Any:
    """``alpha * A' @ B' + beta * C``. With a constant B this is ``F.linear(a, w, b)``: the weight in
    linear's [N, K] layout (transposed into its own buffer when transB=0, alpha folded in) and a bias
    from a constant C that is a per-column vector. Otherwise matmul with the scalings as operators."""
    a, c = ctx.input(0), ctx.optional_input(2)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    trans_a, trans_b = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    if trans_a:
        a = ctx.call(torch.transpose, a, 0, 1)
    b_const = ctx.constant(1)
    if b_const is not None:
        weight = b_const if trans_b else b_const.t().contiguous()
        if alpha != 1.0:
            weight = weight * alpha
        if weight is not b_const:
            ctx.builder.name_constant(weight, f"{ctx.node.input[1]}_{'t' if not trans_b else 'scaled'}")
        bias, rest = _linear_bias(ctx, weight.shape[0], beta)
        y = ctx.call(F.linear, a, weight, bias)
        return y if rest is None else ctx.call(operator.add, y, rest)
    b = ctx.input(1)
    if trans_b:
        b = ctx.call(torch.transpose, b, 0, 1)
    y = ctx.call(torch.matmul, a, b)
    if alpha != 1.0:
        y = ctx.call(operator.mul, y, alpha)
    if c is None or beta == 0.0:
        return y
    return ctx.call(operator.add, y, c if beta == 1.0 else ctx.call(operator.mul, c, beta))


def _linear_bias(ctx: NodeContext, n: int, beta: float) -> tuple[Any, Any]:
    """(bias for F.linear, term to add afterwards) from Gemm's C: a constant per-column C (shape [N],
    [1, N] or one element) is linear's bias; any other C is added after."""
    c = ctx.optional_input(2)
    if c is None or beta == 0.0:
        return None, None
    const = ctx.constant(2)
    if const is not None and (const.numel() == 1 or (const.numel() == n and const.shape[-1] == n)):
        if const.shape == (n,):
            bias = const
        else:
            bias = const.reshape(-1).expand(n).contiguous() if const.numel() == 1 else const.reshape(n)
        if beta != 1.0:
            bias = bias * beta
        if bias is not const:
            ctx.builder.name_constant(bias, f"{ctx.node.input[2]}_bias")
        return bias, None
    return None, (c if beta == 1.0 else ctx.call(operator.mul, c, beta))


def _pool_windows(ctx: NodeContext, n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    kernel = list(ctx.attr("kernel_shape", []))
    if len(kernel) != n:
        raise ctx.invalid(f"kernel_shape {kernel} for a {n}-D pool")
    strides = list(ctx.attr("strides", [1] * n))
    dilations = list(ctx.attr("dilations", [1] * n))
    return kernel, strides, dilations, _window_pads(ctx, kernel, strides, dilations)


@converter("MaxPool", versions=(8, 10, 11, 12, 22))
def max_pool(ctx: NodeContext) -> Any:
    if int(ctx.attr("storage_order", 0)) != 0:
        raise ctx.unsupported("storage_order=1")
    x = ctx.input(0)
    n = _spatial_rank(ctx, 0, "MaxPool")
    kernel, strides, dilations, pads = _pool_windows(ctx, n)
    begins, ends = pads[:n], pads[n:]
    # torch pools only pad symmetrically and by at most half the (dilated) window.
    fits = all(2 * p <= (k - 1) * d + 1 for p, k, d in zip(begins, kernel, dilations, strict=True))
    if begins == ends and fits:
        padding = tuple(begins)
    else:
        x = ctx.call(F.pad, x, torch_pad(begins, ends), value=-math.inf)
        padding = (0,) * n
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    return ctx.call(_MAX_POOL[n], x, tuple(kernel), tuple(strides), padding, tuple(dilations), ceil_mode)


@converter("AveragePool", versions=(7, 10, 11, 19, 22))
def average_pool(ctx: NodeContext) -> Any:
    x = ctx.input(0)
    n = _spatial_rank(ctx, 0, "AveragePool")
    kernel, strides, dilations, pads = _pool_windows(ctx, n)
    if any(d != 1 for d in dilations):
        raise ctx.unsupported(f"dilations={dilations}")
    begins, ends = pads[:n], pads[n:]
    count_include_pad = bool(ctx.attr("count_include_pad", 0))
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    fits = all(2 * p <= k for p, k in zip(begins, kernel, strict=True))
    if begins == ends and fits:
        padding = tuple(begins)
    elif count_include_pad and not ceil_mode:
        x = ctx.call(F.pad, x, torch_pad(begins, ends))
        padding = (0,) * n
    else:
        raise ctx.unsupported(
            f"pads {pads} (asymmetric or wider than half the window) with "
            f"count_include_pad={int(count_include_pad)}, ceil_mode={int(ceil_mode)}"
        )
    return ctx.call(_AVG_POOL[n], x, tuple(kernel), tuple(strides), padding, ceil_mode, count_include_pad)


@converter("GlobalAveragePool", versions=(1, 22))
def global_average_pool(ctx: NodeContext) -> Any:
    x = ctx.input(0)
    rank = ctx.require_rank(0)
    if rank == 4:
        return ctx.call(F.adaptive_avg_pool2d, x, 1)
    return ctx.call(torch.mean, x, dim=tuple(range(2, rank)), keepdim=True)


@converter("LayerNormalization", versions=(17,))
def layer_norm(ctx: NodeContext) -> Any:
    """``F.layer_norm`` over the dims from ``axis`` on. Their sizes come from the scale when it has
    them (a constant's shape) or from shape inference: normalized dims are features, never the batch."""
    x, scale, bias = ctx.input(0), ctx.input(1), ctx.optional_input(2)
    rank = ctx.require_rank(0)
    axis = int(ctx.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    eps = float(ctx.attr("epsilon", 1e-5))
    dims = (ctx.static_shape(0) or [None] * rank)[axis:]
    scale_shape = ctx.static_shape(1)
    if scale_shape is not None and len(scale_shape) == rank - axis and None not in scale_shape:
        dims = [s if d is None else d for s, d in zip(scale_shape, dims, strict=True)]
    if None in dims:
        raise ctx.unsupported(f"normalized dims {dims} not known at import time")
    shape = tuple(int(d) for d in dims)
    if scale_shape is not None and tuple(scale_shape) == shape:
        bias_shape = ctx.static_shape(2)
        if bias is None or (bias_shape is not None and tuple(bias_shape) == shape):
            return ctx.call(F.layer_norm, x, shape, scale, bias, eps)
    y = ctx.call(operator.mul, ctx.call(F.layer_norm, x, shape, None, None, eps), scale)
    return y if bias is None else ctx.call(operator.add, y, bias)


def _reduce(ctx: NodeContext, axes: list[int] | None, target: Any, **options: Any) -> Any:
    """``target(x, dim=axes, keepdim=...)``, ONNX's reductions: no axes means every axis, or none at all
    with ``noop_with_empty_axes``."""
    x = ctx.input(0)
    keepdim = bool(ctx.attr("keepdims", 1))
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return x
        if not keepdim:
            return ctx.call(target, x, **options)
        axes = list(range(ctx.require_rank(0)))
    return ctx.call(target, x, dim=tuple(axes), keepdim=keepdim, **options)


# ONNX's reductions: the torch call each is (with its fixed options), the schema versions that take the axes as
# an attribute, and those that take them as an input. ReduceL2 is the dynamo exporter's weight norm (wav2vec
# 2.0's positional conv); ReduceSum sums ResNeSt's and SKNet's split-attention branches.
_REDUCTIONS: dict[str, tuple[Any, dict[str, Any], tuple[int, ...], tuple[int, ...]]] = {
    "ReduceMean": (torch.mean, {}, (1, 11, 13), (18,)),
    "ReduceL2": (torch.linalg.vector_norm, {"ord": 2}, (1, 11, 13), (18,)),
    "ReduceSum": (torch.sum, {}, (1, 11), (13,)),
    "ReduceMax": (torch.amax, {}, (1, 11, 12, 13), (18, 20)),
    "ReduceMin": (torch.amin, {}, (1, 11, 12, 13), (18, 20)),
}


def _register_reduction(op_type: str, target: Any, options: dict[str, Any], attribute: tuple, inputs: tuple) -> None:
    """Two converters per table entry: axes from the attribute, and axes from input 1 (a constant)."""

    @converter(op_type, versions=attribute)
    def from_attribute(ctx: NodeContext) -> Any:
        return _reduce(ctx, ctx.attr("axes"), target, **options)

    @converter(op_type, versions=inputs)
    def from_input(ctx: NodeContext) -> Any:
        return _reduce(ctx, ctx.constant_ints(1, "axes"), target, **options)

    from_attribute.__name__ = from_attribute.__qualname__ = f"{op_type.lower()}_attribute"
    from_input.__name__ = from_input.__qualname__ = f"{op_type.lower()}_input"


for _op, (_target, _options, _attribute, _inputs) in _REDUCTIONS.items():
    _register_reduction(_op, _target, _options, _attribute, _inputs)


@converter("InstanceNormalization", versions=(6, 22))
def instance_norm(ctx: NodeContext) -> Any:
    """Each sample's channels normalized over their own pixels, then scaled and shifted per channel (torch.onnx's
    form of ``GroupNorm`` with a group per channel, wav2vec 2.0's first feature conv)."""
    x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    eps = float(ctx.attr("epsilon", 1e-5))
    return ctx.call(F.instance_norm, x, None, None, scale, bias, True, 0.0, eps)


@converter("CumSum", versions=(11, 14))
def cumsum(ctx: NodeContext) -> Any:
    """``torch.cumsum`` along the constant ``axis`` input, in the input's dtype (torch would widen
    int32 to int64); ``reverse`` flips before and after, ``exclusive`` subtracts each element."""
    x = ctx.input(0)
    axes = ctx.constant_ints(1, "axis")
    if axes is None or len(axes) != 1:
        raise ctx.invalid(f"axis {axes} (expected one value)")
    axis = axes[0]
    if ctx.attr("reverse", 0):
        x = ctx.call(torch.flip, x, (axis,))
    y = ctx.call(torch.cumsum, x, axis, dtype=ctx.dtype(0))
    if ctx.attr("exclusive", 0):
        y = ctx.call(operator.sub, y, x)
    return ctx.call(torch.flip, y, (axis,)) if ctx.attr("reverse", 0) else y


_INTERPOLATION = {("linear", 1): "linear", ("linear", 2): "bilinear", ("linear", 3): "trilinear"}


@converter("Resize", versions=(11, 13, 18, 19))
def resize(ctx: NodeContext) -> Any:
    """``F.interpolate`` for the ONNX resize forms torch has an exact twin of:

    - nearest, asymmetric, floor -> mode "nearest" (how torch exports ``mode="nearest"``);
    - nearest, half_pixel / pytorch_half_pixel, round_prefer_ceil -> "nearest-exact"; with
      round_prefer_floor only for integer upsampling factors, where rounding never meets a tie;
    - linear / cubic, half_pixel or pytorch_half_pixel -> align_corners=False, align_corners -> True
      (cubic only with torch's coefficient -0.75 and exclude_outside=0).
    Output sizes come from ``sizes`` (run-time entries allowed) or constant ``scales``; the batch and
    channel dims must not be resized.
    """
    x = ctx.input(0)
    rank = ctx.require_rank(0)
    n = rank - 2
    if n not in (1, 2, 3):
        raise ctx.unsupported(f"Resize of a rank-{rank} tensor")
    if ctx.attr("antialias", 0):
        raise ctx.unsupported("antialias=1")
    if ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise ctx.unsupported(f"keep_aspect_ratio_policy={ctx.attr('keep_aspect_ratio_policy')!r}")
    mode = ctx.attr("mode", "nearest")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    axes = ctx.attr("axes")
    axes = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in axes]

    size, scales = _resize_target(ctx, rank, axes)
    kwargs: dict[str, Any] = {}
    if mode == "nearest":
        nearest = ctx.attr("nearest_mode", "round_prefer_floor")
        integer_up = scales is not None and all(s >= 1 and float(s).is_integer() for s in scales)
        if transform == "asymmetric" and nearest == "floor":
            kwargs["mode"] = "nearest"
        elif transform in ("half_pixel", "pytorch_half_pixel") and (
            nearest == "round_prefer_ceil" or (nearest == "round_prefer_floor" and integer_up)
        ):
            kwargs["mode"] = "nearest-exact"
        else:
            raise ctx.unsupported(
                f"mode='nearest' with coordinate_transformation_mode={transform!r}, nearest_mode={nearest!r}"
            )
    elif mode in ("linear", "cubic"):
        if mode == "cubic":
            if n != 2:
                raise ctx.unsupported(f"cubic Resize of {n} spatial dims")
            if float(ctx.attr("cubic_coeff_a", -0.75)) != -0.75 or ctx.attr("exclude_outside", 0):
                raise ctx.unsupported("cubic_coeff_a other than -0.75 or exclude_outside=1")
            kwargs["mode"] = "bicubic"
        else:
            kwargs["mode"] = _INTERPOLATION[("linear", n)]
        if transform == "align_corners":
            kwargs["align_corners"] = True
        elif transform in ("half_pixel", "pytorch_half_pixel"):
            kwargs["align_corners"] = False
        else:
            raise ctx.unsupported(f"mode={mode!r} with coordinate_transformation_mode={transform!r}")
    else:
        raise ctx.invalid(f"mode={mode!r}")
    if size is not None:
        return ctx.call(F.interpolate, x, size=size, **kwargs)
    return ctx.call(F.interpolate, x, scale_factor=tuple(scales), **kwargs)


def _resize_target(ctx: NodeContext, rank: int, axes: list[int]) -> tuple[tuple | None, list[float] | None]:
    """(spatial output size, None) from ``sizes`` or (None, spatial scales) from ``scales``.

    The batch and channel entries of ``sizes`` are not used: a graph exported at batch 1 carries a
    stale batch size there, and the batch stays dynamic.
    """
    sizes_value = ctx.optional_input(3)
    if sizes_value is not None:
        sizes = as_shape_value(sizes_value)
        if sizes is None:
            raise ctx.unsupported("sizes computed as a run-time tensor")
        if len(sizes.items) != len(axes):
            raise ctx.invalid(f"{len(sizes.items)} sizes for axes {axes}")
        by_axis = dict(zip(axes, sizes.items, strict=True))
        channels = (ctx.static_shape(0) or [None, None])[1]
        if isinstance(by_axis.get(1), int) and channels is not None and by_axis[1] != channels:
            raise ctx.unsupported(f"sizes {list(sizes.items)} that resize the channel dimension")
        spatial = tuple(by_axis[d] if d in by_axis else ctx.size(ctx.input(0), d) for d in range(2, rank))
        return spatial, None
    scales = ctx.constant(2)
    if scales is None or scales.numel() == 0:
        raise ctx.unsupported("Resize without constant scales or sizes")
    if scales.numel() != len(axes):
        raise ctx.invalid(f"{scales.numel()} scales for axes {axes}")
    full_scales = [1.0] * rank
    for axis, s in zip(axes, scales.tolist(), strict=True):
        full_scales[axis] = float(s)
    if full_scales[0] != 1.0 or full_scales[1] != 1.0:
        raise ctx.unsupported(f"scales {full_scales} that resize the batch or channel dimension")
    return None, full_scales[2:]


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@converter("Pad", versions=(11, 13, 18, 19, 21, 23, 24, 25))
def pad(ctx: NodeContext) -> Any:
    """``F.pad``; pads must be known at import time. The non-constant modes pad at most the last three
    dims of a 2-D to 5-D tensor in torch, so the padded dims are widened to a form torch accepts."""
    x = ctx.input(0)
    mode = ctx.attr("mode", "constant")
    if mode not in _PAD_MODES:
        raise ctx.invalid(f"mode={mode!r}")
    pads = ctx.constant_ints(1, "pads")
    rank = ctx.require_rank(0)
    axes = ctx.constant_ints(3, "axes") if ctx.opset >= 18 else None
    axes = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in axes]
    if pads is None or len(pads) != 2 * len(axes):
        raise ctx.invalid(f"pads {pads} for axes {axes}")
    per_dim = [(0, 0)] * rank
    for k, axis in enumerate(axes):
        per_dim[axis] = (pads[k], pads[k + len(axes)])
    padded = [d for d in range(rank) if per_dim[d] != (0, 0)]
    if not padded:
        return x
    first = padded[0]
    if mode != "constant":
        if any(p < 0 for pair in per_dim for p in pair):
            raise ctx.unsupported(f"negative pads with mode={mode!r}")
        # torch pads k <= 3 trailing dims of a tensor of rank k + 1 or k + 2: never the batch dim.
        first = min(first, 2)
        if first < 1 or rank - first > 3:
            raise ctx.unsupported(f"mode={mode!r} padding dims {padded} of a rank-{rank} tensor")
    begins = [per_dim[d][0] for d in range(first, rank)]
    ends = [per_dim[d][1] for d in range(first, rank)]
    if mode == "constant":
        value = ctx.constant(2)
        if ctx.has_input(2) and value is None:
            raise ctx.unsupported("a constant_value computed at run time")
        fill = 0 if value is None or value.numel() == 0 else python_scalar(value)
        return ctx.call(F.pad, x, torch_pad(begins, ends), mode="constant", value=fill)
    return ctx.call(F.pad, x, torch_pad(begins, ends), mode=_PAD_MODES[mode])
