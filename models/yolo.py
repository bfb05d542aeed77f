"""A YOLOv8-style detector, built from a YAML-like layer list the way ultralytics builds its models.

The layer list ``YOLOV8`` is ultralytics' ``yolov8.yaml``: rows of ``[from, repeats, module, args]``.
``parse_model`` turns it into an ``nn.ModuleList`` whose modules carry ``.i`` (their index) and ``.f``
(where their input comes from: -1 for the previous layer, an index, or a list of indices), and
``DetectionModel.forward`` routes through that list, keeping only the outputs listed in ``save``.

The parts: ``Conv`` (Conv2d without bias -> BatchNorm2d -> SiLU), ``C2f`` (split, a chain of
``Bottleneck`` blocks with shortcut adds, concat), ``SPPF`` (three chained 5x5 max pools), an FPN/PAN
neck (``nn.Upsample`` + ``Concat``) and a decoupled ``Detect`` head (box branch of 4 * reg_max channels,
class branch, final 1x1 convs with bias and no activation) with DFL box decoding and class sigmoid.

``Detect`` caches its anchors and compares the input shape to decide when to rebuild them
(``if self.shape != shape``), exactly as ultralytics does. That comparison is Python control flow on a
traced value, so ``torch.fx.symbolic_trace`` of the whole model fails, by design: a fusion library must
then trace the largest submodules that do trace (every backbone and neck block does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .common import RESIDUAL_SCALE, build_seeded, randomize_batchnorm, scale_batchnorm

# ultralytics/cfg/models/v8/yolov8.yaml. scales: [depth multiple, width multiple, max channels].
YOLOV8: dict[str, Any] = {
    "nc": 80,
    "scales": {
        "n": [0.33, 0.25, 1024],
        "s": [0.33, 0.50, 1024],
        "m": [0.67, 0.75, 768],
        "l": [1.00, 1.00, 512],
        "x": [1.00, 1.25, 512],
    },
    "backbone": [
        [-1, 1, "Conv", [64, 3, 2]],  # 0-P1/2
        [-1, 1, "Conv", [128, 3, 2]],  # 1-P2/4
        [-1, 3, "C2f", [128, True]],
        [-1, 1, "Conv", [256, 3, 2]],  # 3-P3/8
        [-1, 6, "C2f", [256, True]],
        [-1, 1, "Conv", [512, 3, 2]],  # 5-P4/16
        [-1, 6, "C2f", [512, True]],
        [-1, 1, "Conv", [1024, 3, 2]],  # 7-P5/32
        [-1, 3, "C2f", [1024, True]],
        [-1, 1, "SPPF", [1024, 5]],  # 9
    ],
    "head": [
        [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
        [[-1, 6], 1, "Concat", [1]],  # cat backbone P4
        [-1, 3, "C2f", [512]],  # 12
        [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
        [[-1, 4], 1, "Concat", [1]],  # cat backbone P3
        [-1, 3, "C2f", [256]],  # 15 (P3/8-small)
        [-1, 1, "Conv", [256, 3, 2]],
        [[-1, 12], 1, "Concat", [1]],  # cat head P4
        [-1, 3, "C2f", [512]],  # 18 (P4/16-medium)
        [-1, 1, "Conv", [512, 3, 2]],
        [[-1, 9], 1, "Concat", [1]],  # cat head P5
        [-1, 3, "C2f", [1024]],  # 21 (P5/32-large)
        [[15, 18, 21], 1, "Detect", ["nc"]],  # Detect(P3, P4, P5)
    ],
}


class Conv(nn.Module):
    """Conv2d (no bias, 'same' padding for odd k) -> BatchNorm2d -> SiLU: YOLO's basic block."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        # ultralytics trains with eps 1e-3 (initialize_weights); keeping it exercises eps in BN folding.
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    def declared_chain_heads(self) -> list[str]:
        return ["conv"]


class Bottleneck(nn.Module):
    """Two 3x3 Convs, plus the input (a shortcut add after the SiLU) when shapes allow."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 3, 1)
        self.cv2 = Conv(c_, c2, 3, 1)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C2f(nn.Module):
    """CSP bottleneck with two convolutions: 1x1 Conv, split in two, n Bottlenecks on the second half
    (each output kept), concat everything, 1x1 Conv."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, e: float = 0.5) -> None:
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, e=1.0) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = self.cv1(x).split((self.c, self.c), 1)
        y = [halves[0], halves[1]]  # indexed, not list(...): a traced value cannot be iterated
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: 1x1 Conv, three chained k x k max pools, concat, 1x1 Conv."""

    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``."""

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)


class DFL(nn.Module):
    """Distribution focal loss decoding: softmax over ``c1`` bins per box side, then the expected bin,
    computed as a fixed 1x1 conv whose weights are 0, 1, ..., c1 - 1."""

    def __init__(self, c1: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        self.conv.weight.data[:] = torch.arange(c1, dtype=torch.float).view(1, c1, 1, 1)
        self.c1 = c1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, a = x.shape[0], x.shape[2]
        return self.conv(x.view(b, 4, self.c1, a).transpose(2, 1).softmax(1)).view(b, 4, a)


def make_anchors(
    feats: Sequence[torch.Tensor], strides: Sequence[float], offset: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor points (cell centres, in grid units) and their strides for each feature map, concatenated:
    shapes [A, 2] and [A, 1]."""
    points, stride_list = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for feat, stride in zip(feats, strides, strict=True):
        h, w = feat.shape[2:]
        sx = torch.arange(w, device=device, dtype=dtype) + offset
        sy = torch.arange(h, device=device, dtype=dtype) + offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((sx, sy), -1).view(-1, 2))
        stride_list.append(torch.full((h * w, 1), stride, dtype=dtype, device=device))
    return torch.cat(points), torch.cat(stride_list)


def dist2bbox(distance: torch.Tensor, anchor_points: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """(left, top, right, bottom) distances from anchor points -> (x centre, y centre, width, height)."""
    lt, rb = distance.chunk(2, dim)
    x1y1 = anchor_points - lt
    x2y2 = anchor_points + rb
    return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)


class Detect(nn.Module):
    """Decoupled detection head over several feature maps; returns [B, 4 + nc, anchors]: boxes as
    (x, y, w, h) in input pixels, then class probabilities."""

    def __init__(self, nc: int, ch: Sequence[int], stride: Sequence[float], reg_max: int = 16) -> None:
        super().__init__()
        self.nc = nc
        self.nl = len(ch)
        self.reg_max = reg_max
        self.no = nc + reg_max * 4
        self.stride = tuple(float(s) for s in stride)
        c2 = max(16, ch[0] // 4, reg_max * 4)
        c3 = max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch
        )
        self.cv3 = nn.ModuleList(nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)
        self.dfl = DFL(reg_max)
        self._reset_anchors()

    def _reset_anchors(self) -> None:
        self.shape: torch.Size | None = None
        self.anchors = torch.empty(0)
        self.strides = torch.empty(0)

    def _apply(self, fn: Any, recurse: bool = True) -> Detect:
        # .to() / .double() / .cuda() change dtype or device but not the shape the cache is keyed on.
        self._reset_anchors()
        return super()._apply(fn, recurse)

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        x = [torch.cat((self.cv2[i](x[i]), self.cv3[i](x[i])), 1) for i in range(self.nl)]
        shape = x[0].shape
        x_cat = torch.cat([xi.view(shape[0], self.no, -1) for xi in x], 2)
        if self.shape != shape:
            anchors, strides = make_anchors(x, self.stride, 0.5)
            self.anchors, self.strides = anchors.transpose(0, 1), strides.transpose(0, 1)
            self.shape = shape
        box, cls = x_cat.split((self.reg_max * 4, self.nc), 1)
        dbox = dist2bbox(self.dfl(box), self.anchors.unsqueeze(0), dim=1) * self.strides
        return torch.cat((dbox, cls.sigmoid()), 1)


_MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv,
    "C2f": C2f,
    "SPPF": SPPF,
    "nn.Upsample": nn.Upsample,
    "Concat": Concat,
    "Detect": Detect,
}


def make_divisible(x: float, divisor: int = 8) -> int:
    """The smallest multiple of ``divisor`` that is >= x."""
    return math.ceil(x / divisor) * divisor


def parse_model(cfg: dict[str, Any], scale: str, nc: int, ch: int = 3) -> tuple[nn.ModuleList, list[int]]:
    """Build the layer list of ``cfg`` at ``scale``; returns (layers, save): the indices whose outputs
    later layers read.

    Strides are propagated statically (stride-s Convs multiply, Upsample divides, Concat requires its
    inputs to agree), so the Detect head knows each input's stride without a dry-run forward pass.
    """
    if scale not in cfg["scales"]:
        raise KeyError(f"unknown YOLOv8 scale {scale!r}; known: {', '.join(cfg['scales'])}")
    depth, width, max_channels = cfg["scales"][scale]
    channels: list[int] = []  # output channels per layer
    strides: list[float] = []  # output stride (input pixels per cell) per layer
    layers: list[nn.Module] = []
    save: set[int] = set()

    def source(j: int, i: int, values: list, first: float) -> float:
        return first if (j == -1 and i == 0) else values[j]

    for i, (f, n, name, args) in enumerate(cfg["backbone"] + cfg["head"]):
        if name not in _MODULES:
            raise KeyError(f"layer {i}: unknown module {name!r}; known: {', '.join(_MODULES)}")
        kind = _MODULES[name]
        n = max(round(n * depth), 1) if n > 1 else n
        sources = [f] if isinstance(f, int) else list(f)
        c_in = [source(j, i, channels, ch) for j in sources]
        s_in = [source(j, i, strides, 1.0) for j in sources]
        if kind in (Conv, C2f, SPPF):
            c1, c2 = int(c_in[0]), make_divisible(min(args[0], max_channels) * width, 8)
            if kind is Conv:
                module: nn.Module = Conv(c1, c2, *args[1:])
                stride = s_in[0] * (args[2] if len(args) > 2 else 1)
            elif kind is C2f:
                module, stride = C2f(c1, c2, n, *args[1:]), s_in[0]
            else:
                module, stride = SPPF(c1, c2, *args[1:]), s_in[0]
        elif kind is nn.Upsample:
            module = nn.Upsample(*args)
            c2, stride = int(c_in[0]), s_in[0] / args[1]
        elif kind is Concat:
            if len(set(s_in)) != 1:
                raise ValueError(f"layer {i}: Concat of inputs {sources} with different strides {s_in}")
            module, c2, stride = Concat(*args), int(sum(c_in)), s_in[0]
        else:
            module = Detect(nc, [int(c) for c in c_in], s_in)
            c2, stride = 0, 0.0
        module.i, module.f, module.type = i, f, name
        save.update(j % i for j in sources if j != -1)
        layers.append(module)
        channels.append(c2)
        strides.append(stride)
    return nn.ModuleList(layers), sorted(save)


@torch.fx.wrap
def _check_input_size(x: torch.Tensor, multiple: int) -> None:
    # Wrapped for torch.fx: traced as one call, so tracing fails in Detect, where the real model fails.
    if x.dim() != 4 or x.shape[-2] % multiple or x.shape[-1] % multiple:
        raise ValueError(
            f"YOLOv8 detector input must be [B, C, H, W] with H and W multiples of {multiple} "
            f"(its largest stride); got shape {tuple(x.shape)}"
        )


class DetectionModel(nn.Module):
    """A detector routed through ``self.model`` (an nn.ModuleList) by each module's ``.f``."""

    def __init__(self, cfg: dict[str, Any], scale: str = "n", nc: int | None = None, ch: int = 3) -> None:
        super().__init__()
        self.nc = cfg["nc"] if nc is None else nc
        self.model, self.save = parse_model(cfg, scale, self.nc, ch)
        self.max_stride = int(max(self.model[-1].stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input_size(x, self.max_stride)
        y: list[torch.Tensor | None] = []
        for m in self.model:
            if m.f != -1:
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if m.i in self.save else None)
        return x


def _random_detector(scale: str, nc: int, residual_scale: float) -> DetectionModel:
    model = randomize_batchnorm(DetectionModel(YOLOV8, scale, nc))
    for block in model.modules():
        if isinstance(block, Bottleneck) and block.add:
            scale_batchnorm(block.cv2.bn, residual_scale)
    return model


def yolov8(
    scale: str = "n",
    nc: int = 80,
    *,
    seed: int = 0,
    residual_scale: float = RESIDUAL_SCALE,
    calibration_batch: int = 4,
    calibration_size: int = 192,
) -> DetectionModel:
    """A YOLOv8 detector at ``scale`` ("n", "s", "m", "l", "x") with ``nc`` classes, in eval mode.

    Random weights deterministic by ``seed``; randomized BN statistics calibrated on
    ``calibration_batch`` random images of ``calibration_size``^2 (``common.calibrate_batchnorm``);
    the BN ending each Bottleneck's shortcut branch scaled by ``residual_scale``
    (``common.scale_batchnorm``). Input [B, 3, H, W] with H, W multiples of 32; output
    [B, 4 + nc, anchors]: boxes (x, y, w, h) in input pixels, then class probabilities.
    """
    if calibration_size % 32:
        raise ValueError(f"calibration_size must be a multiple of 32, got {calibration_size}")
    model = build_seeded(
        lambda: _random_detector(scale, nc, residual_scale),
        seed,
        (calibration_batch, 3, calibration_size, calibration_size),
    )
    model.model[-1]._reset_anchors()
    return model
