"""GPU benchmark of the fusions between convs against the ops they replace (EfficientNet-B0 and YOLOv8n shapes).

    python -m benchmarks.between_convs --out DIR [--quick]     measure, write DIR/between-convs-<date>.json

Rows (each at batch 1 in float32 and batch 32 in float16, channels_last):
- ``se_pool``: the squeeze-excitation global average pool, torch's ``x.mean((2, 3), keepdim=True)`` vs
  ``fuser.kernels.channel_mean``;
- ``se_scale``: ``conv1x1(x * s)`` as torch's multiply + the fused conv vs the fused conv with the channel
  scale in its operand load (``input_scale``);
- ``neck``: ``conv1x1(cat([upsample_nearest(a, 2), b]))`` as torch's upsample + cat + the fused conv vs the
  fused conv reading the virtual concatenation (``cat_with``).

Every variant is captured in one CUDA graph of ``REPLAYS`` calls (fuser's default runtime) and timed by its
replays, so launch overhead counts as it does in a model; the fused result's error against float64 is kept
with every row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPLAYS = 20

# (C, H) of EfficientNet-B0's SE inputs at 224x224, and (C_in, C_out) of the projection after it
SE = [(32, 112, 16), (96, 56, 24), (144, 28, 40), (240, 14, 80), (672, 14, 112), (1152, 7, 192)]
# YOLOv8n's two upsampling neck steps at 640x640: (C_a, H_a, C_b, C_out)
NECK = [(256, 20, 128, 128), (128, 40, 64, 64)]


def graph_ms(fn: Callable[[], Any], repeats: int = 7) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph of ``REPLAYS`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    return sorted(times)[len(times) // 2]


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _nhwc(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype).to(memory_format=torch.channels_last)


def _conv(c_in: int, c_out: int, dtype: torch.dtype) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from fuser.kernels import pack_conv_weight

    w = torch.randn(c_out, c_in, 1, 1, device="cuda") / c_in**0.5
    precision = "tf32" if dtype == torch.float32 else "fp16"
    return pack_conv_weight(w.to(dtype), precision), w, torch.randn(c_out, device="cuda")


def se_pool_row(batch: int, c: int, h: int, dtype: torch.dtype) -> dict[str, Any]:
    from fuser.kernels.channel_mean import channel_mean_plan

    x = _nhwc(batch, c, h, h, dtype=dtype) + 0.5
    plan = channel_mean_plan(x)
    return {
        "row": "se_pool", "shape": [batch, c, h, h], "dtype": str(dtype),
        "torch_ms": graph_ms(lambda: x.mean((2, 3), keepdim=True)),
        "fuser_ms": graph_ms(lambda: plan(x)),
        "error": _error(plan(x), x.double().mean((2, 3), keepdim=True)),
    }  # fmt: skip


def se_scale_row(batch: int, c: int, h: int, c_out: int, dtype: torch.dtype) -> dict[str, Any]:
    from fuser.kernels import conv2d_act

    x, s = _nhwc(batch, c, h, h, dtype=dtype), torch.rand(batch, c, 1, 1, device="cuda").to(dtype)
    packed, w, b = _conv(c, c_out, dtype)
    ref = F.conv2d(x.double() * s.double(), w.to(dtype).double(), b.double())
    return {
        "row": "se_scale", "shape": [batch, c, h, h], "c_out": c_out, "dtype": str(dtype),
        "torch_mul_then_fused_ms": graph_ms(lambda: conv2d_act(x * s, packed, b)),
        "fuser_ms": graph_ms(lambda: conv2d_act(x, packed, b, input_scale=s)),
        "error": _error(conv2d_act(x, packed, b, input_scale=s), ref),
    }  # fmt: skip


def neck_row(batch: int, c_a: int, h: int, c_b: int, c_out: int, dtype: torch.dtype) -> dict[str, Any]:
    from fuser.kernels import conv2d_act

    a, skip = _nhwc(batch, c_a, h, h, dtype=dtype), _nhwc(batch, c_b, 2 * h, 2 * h, dtype=dtype)
    packed, w, b = _conv(c_a + c_b, c_out, dtype)
    materialized = lambda: torch.cat([F.interpolate(a, scale_factor=2, mode="nearest"), skip], 1)
    ref = F.conv2d(materialized().double(), w.to(dtype).double(), b.double())
    return {
        "row": "neck", "shape": [batch, c_a, h, h], "c_b": c_b, "c_out": c_out, "dtype": str(dtype),
        "torch_upsample_cat_then_fused_ms": graph_ms(lambda: conv2d_act(materialized(), packed, b)),
        "fuser_ms": graph_ms(lambda: conv2d_act(a, packed, b, cat_with=skip, upsample=2)),
        "error": _error(conv2d_act(a, packed, b, cat_with=skip, upsample=2), ref),
    }  # fmt: skip


def rows_for(batch: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    return (
        [se_pool_row(batch, c, h, dtype) for c, h, _ in SE]
        + [se_scale_row(batch, c, h, c_out, dtype) for c, h, c_out in SE]
        + [neck_row(batch, c_a, h, c_b, c_out, dtype) for c_a, h, c_b, c_out in NECK]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="batch 1 float32 only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("between_convs: needs a CUDA GPU", file=sys.stderr)
        return 2
    settings = [(1, torch.float32)] + ([] if args.quick else [(32, torch.float16)])
    rows = [row for batch, dtype in settings for row in rows_for(batch, dtype)]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"between-convs-{dt.date.today().isoformat()}.json"
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    path.write_text(json.dumps(result, indent=1))
    for row in rows:
        base = next(v for k, v in row.items() if k.startswith("torch") and k.endswith("_ms"))
        print(f"{row['row']:9} {row['shape']!s:22} {row['dtype']:14} torch {base:.4f} ms  fuser "
              f"{row['fuser_ms']:.4f} ms  x{base / row['fuser_ms']:.2f}  err {row['error']:.1e}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
