"""A convolution's geometry (stride, padding, dilation, groups) as one value.

The fused conv module holds one :class:`ConvGeometry`; it travels whole to the torch reference, the kernel
planner (fuser.lower.kernel_dispatch) and the custom op, whose schema flattens it (fuser.lower.ops). Padding is always
(top, bottom, left, right): torch's "same" with an even kernel pads one more pixel bottom/right, and ONNX
pads can differ per side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def conv_padding(
    padding: str | int | Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int]
) -> tuple[int, int, int, int]:
    """Any conv padding (int, pair, 4-tuple, "same", "valid") as (top, bottom, left, right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"unknown conv padding {padding!r}")
        pads = []
        for k, d in zip(kernel_size, dilation, strict=True):
            total = d * (k - 1)  # torch's "same": the extra pixel of an even kernel goes bottom/right
            pads += [total // 2, total - total // 2]
        return (pads[0], pads[1], pads[2], pads[3])
    if isinstance(padding, int):
        return (padding, padding, padding, padding)
    padding = tuple(int(p) for p in padding)
    if len(padding) == 2:
        return (padding[0], padding[0], padding[1], padding[1])
    if len(padding) == 4:
        return padding  # type: ignore[return-value]
    raise ValueError(f"conv padding must have 1, 2 or 4 values, got {padding!r}")


def conv_output_size(
    size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding4: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, int]:
    """(OH, OW) of a conv with (top, bottom, left, right) padding."""
    out = []
    for i in range(2):
        padded = size[i] + padding4[2 * i] + padding4[2 * i + 1]
        out.append((padded - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1)
    return out[0], out[1]


@dataclass(frozen=True)
class ConvGeometry:
    """Where a conv's filter taps land: ``stride`` and ``dilation`` as (h, w), ``padding`` as (top, bottom,
    left, right), and ``groups``."""

    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        stride, dilation = tuple(int(s) for s in self.stride), tuple(int(d) for d in self.dilation)
        padding = tuple(int(p) for p in self.padding)
        if len(stride) != 2 or len(dilation) != 2 or len(padding) != 4:
            raise ValueError(
                f"conv geometry needs 2 strides, 2 dilations and 4 paddings (top, bottom, left, right), got "
                f"stride={self.stride}, dilation={self.dilation}, padding={self.padding}"
            )
        if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or int(self.groups) < 1:
            raise ValueError(
                f"conv geometry out of range: stride={stride}, dilation={dilation}, padding={padding}, "
                f"groups={self.groups}"
            )
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "dilation", dilation)
        object.__setattr__(self, "padding", padding)
        object.__setattr__(self, "groups", int(self.groups))

    def output_size(self, size: Sequence[int], kernel_size: Sequence[int]) -> tuple[int, int]:
        """(OH, OW) for an input of spatial ``size`` and a filter of ``kernel_size``."""
        return conv_output_size(size, kernel_size, self.stride, self.padding, self.dilation)
