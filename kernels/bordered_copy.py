"""``bordered_copy``: a channels_last ``[N, C, H, W]`` tensor copied into a new ``[N, H + top, W + left, C]``
buffer whose first ``top`` rows of each image and first ``left`` columns of each row are zero.

Shifted-tap conv tiles (conv_boxes.py) read this buffer instead of the input, so at batch 32 on a 20x20 or 7x7
image the copy is part of every such conv's time (results/conv-tile-sweep-2026-12-03d.json: 13.6 us of 71.1
at 256->256 @20 tf32). Done with torch ops it is three launches (two border fills and a strided copy); here it
is one, which reads the input once and writes every byte of the buffer once, borders included: 5.9 against 12.4
us there (results/bordered-copy-2026-12-03.json).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .launch import LaunchOptions, PlanCache, cdiv, check_device, launch, tensor_meta

# Pixels per program: 64 pixels of up to 128 channels is 32 KB of fp32 written per program, which keeps a
# few hundred programs in flight on the late layers (256 channels at 21x21 x 32 images: 882 programs).
BLOCK_PIXELS = 64


@triton.jit
def _bordered_copy_kernel(
    x_ptr,
    out_ptr,
    C,
    H,
    W,
    pixels,  # N * (H + TOP) * (W + LEFT): the buffer's pixels
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    TOP: tl.constexpr,
    LEFT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    wide = W + LEFT
    col = p % wide - LEFT
    row_of_all = p // wide
    row = row_of_all % (H + TOP) - TOP
    image = row_of_all // (H + TOP)
    p_ok = p < pixels
    c_ok = c < C
    inside = p_ok & (row >= 0) & (col >= 0)
    src = image.to(tl.int64) * sx_n + row.to(tl.int64) * sx_h + col.to(tl.int64) * sx_w
    values = tl.load(x_ptr + src[:, None] + c.to(tl.int64)[None, :] * sx_c, mask=inside[:, None] & c_ok[None, :],
                     other=0.0)  # fmt: skip
    dst = p.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(out_ptr + dst, values, mask=p_ok[:, None] & c_ok[None, :])


def bordered_copy_plan(
    shape: Sequence[int], strides: Sequence[int], top: int, left: int, *, interpret: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call ``run(x) -> buffer`` for every ``[N, C, H, W]`` input ``x`` of this shape and these strides (any; the
    copy is fastest from channels_last), of one dtype, device and 16-byte alignment: the new
    ``[N * (H + top) * (W + left), C]`` buffer holding ``x`` after ``top`` zero rows per image and ``left`` zero
    columns per row. The plan keeps no tensor: a conv plan holds it for as long as the model lives.

    Its launches after the first call the compiled kernel directly (:class:`LaunchOptions`): through
    ``JITFunction.run`` the copy cost more host time than its 2-6 us on the GPU. ``interpret=True`` runs the kernel
    in Triton's interpreter on CPU tensors."""
    if len(shape) != 4 or len(strides) != 4:
        raise ValueError(f"bordered_copy: expected an [N, C, H, W] tensor, got shape {tuple(shape)}")
    if top < 0 or left < 0:
        raise ValueError(f"bordered_copy: borders must be >= 0, got top={top}, left={left}")
    n, c, h, w = shape
    pixels = n * (h + top) * (w + left)
    block_c = min(128, max(16, triton.next_power_of_2(c)))
    grid = (cdiv(pixels, BLOCK_PIXELS), cdiv(c, block_c))
    options = LaunchOptions(dict(TOP=top, LEFT=left, BLOCK_P=BLOCK_PIXELS, BLOCK_C=block_c, num_warps=4))
    scalars = (c, h, w, pixels, *strides)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((pixels, c))
        launch(_bordered_copy_kernel, grid, (x, out, *scalars), options, interpret)
        return out

    return run


_plans = PlanCache()


def bordered_copy(x: torch.Tensor, top: int, left: int, *, interpret: bool = False) -> torch.Tensor:
    """:func:`bordered_copy_plan`'s buffer for ``x`` (on the CPU with ``interpret=True``, else on CUDA), through a
    plan kept per input signature."""
    if x.dim() != 4:
        raise ValueError(f"bordered_copy: expected an [N, C, H, W] tensor, got shape {tuple(x.shape)}")
    check_device("bordered_copy", interpret, {"x": x})
    plan = lambda: bordered_copy_plan(x.shape, x.stride(), top, left, interpret=interpret)
    return _plans.get(lambda: (tensor_meta(x), top, left, interpret), plan)(x)
