"""The zero-bordered copy that shifted-tap conv tiles read (kernels/bordered_copy.py): every value is the
input's or, on the top rows and left columns, an exact zero. A copy has no rounding, so it is checked for
equality with ``F.pad``, in the interpreter and on the GPU, on odd shapes whose channels fill a partial block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels.bordered_copy import BLOCK_PIXELS, bordered_copy, bordered_copy_plan

# (N, C, H, W): odd sizes; 24 and 200 channels leave the last channel block partly past C; 3x5x7 pixels with a
# border do not fill whole pixel blocks, and several images share one block.
SHAPES = [(3, 24, 5, 7), (1, 200, 9, 11), (2, 3, 13, 1)]
BORDERS = [(1, 1), (2, 0), (0, 3)]


def padded(x: torch.Tensor, top: int, left: int) -> torch.Tensor:
    """The reference: ``x`` as NHWC with ``top`` zero rows and ``left`` zero columns in front."""
    return F.pad(x.permute(0, 2, 3, 1), (0, 0, left, 0, top, 0))


def copy_input(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) + 2.0).to(dtype)  # away from zero: a missed value is not a border's
    return x.to(device=device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize(("top", "left"), BORDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_bordered_copy_is_the_input_after_zero_rows_and_columns(
    shape: tuple[int, ...], top: int, left: int, channels_last: bool
) -> None:
    x = copy_input(shape, torch.float32, channels_last, "cpu")
    n, c, h, w = shape
    out = bordered_copy(x, top, left, interpret=True)
    assert out.shape == (n * (h + top) * (w + left), c) and out.is_contiguous()
    assert torch.equal(out.view(n, h + top, w + left, c), padded(x, top, left))


def test_more_pixels_than_one_block_and_a_16_bit_dtype() -> None:
    x = copy_input((2, 40, 7, 9), torch.float16, True, "cpu")
    assert BLOCK_PIXELS < 2 * 8 * 10
    assert torch.equal(bordered_copy(x, 1, 1, interpret=True).view(2, 8, 10, 40), padded(x, 1, 1))


@pytest.mark.parametrize(
    ("shape", "top", "left", "interpret", "message"),
    [
        ((3, 24, 5), 1, 1, True, r"\[N, C, H, W\].*\(3, 24, 5\)"),
        ((1, 8, 3, 3), -1, 1, True, "top=-1"),
        ((1, 8, 3, 3), 1, 1, False, "need CUDA tensors, but x is on cpu"),
    ],
)
def test_bad_input_is_named(shape: tuple[int, ...], top: int, left: int, interpret: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bordered_copy(torch.ones(shape), top, left, interpret=interpret)


def test_a_plan_serves_every_input_of_its_signature() -> None:
    """One plan per input signature: a second input of the same shape gets its own values, not the first's."""
    first = copy_input((2, 24, 5, 7), torch.float32, True, "cpu")
    second = -first
    plan = bordered_copy_plan(first.shape, first.stride(), 1, 2, interpret=True)
    assert torch.equal(plan(first).view(2, 6, 9, 24), padded(first, 1, 2))
    assert torch.equal(plan(second).view(2, 6, 9, 24), padded(second, 1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [*SHAPES, (32, 256, 20, 20), (32, 512, 7, 7)], ids=str)
def test_the_bordered_copy_on_the_gpu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Twice per shape: the second input, of the same signature, goes through the plan's direct launch."""
    n, c, h, w = shape
    for sign in (1, -1):
        x = copy_input(shape, dtype, True, "cuda") * sign
        assert torch.equal(bordered_copy(x, 1, 1).view(n, h + 1, w + 1, c), padded(x, 1, 1))
