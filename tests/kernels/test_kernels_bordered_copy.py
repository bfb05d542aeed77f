"""The zero-bordered copy that shifted-tap conv tiles read (kernels/bordered_copy.py): every value is the
input's or, on the top rows and left columns, an exact zero. A copy has no rounding, so it is checked for
equality with ``F.pad``, in the interpreter and on the GPU, on odd shapes whose channels fill a partial block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels.bordered_copy import BLOCK_PIXELS, bordered_copy

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
    ("shape", "top", "left", "message"),
    [((3, 24, 5), 1, 1, r"\[N, C, H, W\].*\(3, 24, 5\)"), ((1, 8, 3, 3), -1, 1, "top=-1")],
)
def test_bad_input_is_named(shape: tuple[int, ...], top: int, left: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bordered_copy(torch.ones(shape), top, left, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [*SHAPES, (32, 256, 20, 20), (32, 512, 7, 7)], ids=str)
def test_the_bordered_copy_on_the_gpu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = copy_input(shape, dtype, True, "cuda")
    n, c, h, w = shape
    assert torch.equal(bordered_copy(x, 1, 1).view(n, h + 1, w + 1, c), padded(x, 1, 1))
