"""Depthwise conv tiles on the GPU: every (tile, tap loop) on the depthwise layers of EfficientNet-B0 and
MobileNetV3-Large, against cuDNN, each configuration checked against float64.

    python -m benchmarks.depthwise_sweep --out DIR [--budget-s 240]

The whole-model timelines (benchmarks/kernel_timeline.py) showed the depthwise kernel at 3-8x cuDNN's time
on these layers: the 5x5 filters unrolled ran at 255 registers per thread, batch-1 grids of 8-50 programs
left most of the 132 SMs idle, and at batch 32 in fp16 two layers took 0.38 and 0.73 ms with 128x64
tiles. This measures which tile and tap loop each layer wants, so the candidate list and the shipped
defaults come from measurements. Timings replay a CUDA graph (fuser.kernels.autotune.do_bench_ms);
"cudnn_ms" is what torch.compile runs for such a block: cuDNN's depthwise conv on the folded weights,
then SiLU. Writes ``depthwise-sweep.json``; prints per layer the best configuration, the default's
and cuDNN's times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (channels, kernel, stride, input size, how many times the model has it)
LAYERS = {
    "efficientnet_b0": [
        (32, 3, 1, 112, 1), (96, 3, 2, 112, 1), (144, 3, 1, 56, 1), (144, 5, 2, 56, 1), (240, 5, 1, 28, 1),
        (240, 3, 2, 28, 1), (480, 3, 1, 14, 2), (480, 5, 1, 14, 1), (672, 5, 1, 14, 2), (672, 5, 2, 14, 1),
        (1152, 5, 1, 7, 3), (1152, 3, 1, 7, 1),
    ],
    "mobilenet_v3_large": [
        (16, 3, 1, 112, 1), (64, 3, 2, 112, 1), (72, 3, 1, 56, 1), (72, 5, 2, 56, 1), (120, 5, 1, 28, 2),
        (240, 3, 2, 28, 1), (200, 3, 1, 14, 1), (184, 3, 1, 14, 2), (480, 3, 1, 14, 1), (672, 3, 1, 14, 1),
        (672, 5, 2, 14, 1), (960, 5, 1, 7, 2),
    ],
}  # fmt: skip
REGIMES = [(1, "float32", "tf32"), (32, "float16", "fp16")]
TILES = [(16, 64, 4), (32, 64, 4), (64, 64, 4), (32, 128, 4), (64, 32, 4), (128, 64, 4), (64, 128, 8)]


def layer_row(c: int, k: int, stride: int, size: int, batch: int, dtype_name: str, precision: str) -> dict:
    from fuser.epilogue import Activation, Epilogue
    from fuser.kernels import depthwise
    from fuser.kernels.autotune import TileConfig, do_bench_ms

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(c * 31 + k)
    x64 = torch.randn(batch, c, size, size, generator=gen, dtype=torch.float64)
    w64 = torch.randn(c, 1, k, k, generator=gen, dtype=torch.float64) / k
    b64 = torch.randn(c, generator=gen, dtype=torch.float64)
    pad = k // 2
    ref = F.silu(F.conv2d(x64, w64, b64, stride, pad, 1, c))
    x = x64.to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    w_taps = w64.reshape(c, k * k).t().contiguous().to("cuda", dtype)  # [KH*KW, C]
    bias32 = b64.float().cuda()
    oh = (size + 2 * pad - k) // stride + 1
    out = torch.empty(batch, oh, oh, c, device="cuda", dtype=dtype)
    epilogue = Epilogue(act=Activation.SILU)
    w_cl, b_cl = w64.to("cuda", dtype), b64.to("cuda", dtype)
    cudnn = do_bench_ms(lambda: F.silu(F.conv2d(x, w_cl, b_cl, stride, pad, 1, c)))
    row = {"c": c, "k": k, "stride": stride, "size": size, "batch": batch, "dtype": dtype_name, "cudnn_ms": cudnn}

    shipped = depthwise.UNROLL_MAX_TAPS

    def plan(tile, unroll_max):
        depthwise.UNROLL_MAX_TAPS = unroll_max
        try:
            return depthwise.prepare_depthwise(x, w_taps, (k, k), bias32, epilogue, None, out, (stride, stride),
                                               (pad, pad, pad, pad), (1, 1), False, precision, tile=tile)  # fmt: skip
        finally:
            depthwise.UNROLL_MAX_TAPS = shipped

    default = plan(None, shipped)
    default(x, w_taps, bias32, None, out)
    row["default_ms"] = do_bench_ms(lambda: default(x, w_taps, bias32, None, out))
    configs = {}
    for unroll in [True, False] if k * k > 9 else [True]:
        for bm, bn, warps in TILES:
            name = f"{bm}x{bn}w{warps}{'u' if unroll else 'r'}"
            try:
                run = plan(TileConfig(bm, bn, 1, 1, warps, 1), 100 if unroll else 0)
                out.fill_(float("nan"))
                run(x, w_taps, bias32, None, out)
                got = out.permute(0, 3, 1, 2).double().cpu()
                err = float((got - ref).norm() / ref.norm())
                ms = do_bench_ms(lambda run=run: run(x, w_taps, bias32, None, out))
                configs[name] = {"ms": ms, "rel_error": err}
            except Exception as e:  # a tile that does not compile is a finding, not a stop
                configs[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    row["configs"] = configs
    timed = {n: v["ms"] for n, v in configs.items() if "ms" in v}
    row["best"] = min(timed, key=timed.get) if timed else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    from benchmarks.gpu_models import versions

    header = {
        "benchmark": "depthwise_sweep",
        "date": time.strftime("%Y-%m-%d"),
        "card": torch.cuda.get_device_name(),
        "versions": versions(),
        "tiles": TILES,
    }
    rows = []
    seen = set()
    for batch, dtype_name, precision in REGIMES:
        for model, layers in LAYERS.items():
            for c, k, stride, size, count in layers:
                if time.perf_counter() - start > args.budget_s:
                    break
                if (c, k, stride, size, batch) in seen:
                    continue
                seen.add((c, k, stride, size, batch))
                row = layer_row(c, k, stride, size, batch, dtype_name, precision)
                row.update(model=model, count=count)
                rows.append(row)
                (args.out / "depthwise-sweep.json").write_text(json.dumps({**header, "rows": rows}, indent=1))
                worst = max((v.get("rel_error", 0.0) for v in row["configs"].values()), default=0.0)
                best = row["configs"][row["best"]]["ms"] if row["best"] else float("nan")
                head = f"{model[:9]} b{batch} {dtype_name[:5]} c{c} k{k} s{stride} @{size}"
                us = f"cudnn {row['cudnn_ms'] * 1e3:6.1f} default {row['default_ms'] * 1e3:6.1f} best {best * 1e3:6.1f}"
                print(f"{head}: {us} us ({row['best']}) max err {worst:.1e}", flush=True)
    by_config: dict[str, float] = {}
    for row in rows:
        for name, v in row["configs"].items():
            if "ms" in v:
                by_config[name] = by_config.get(name, 0.0) + v["ms"] / row["cudnn_ms"]
    print(
        "sum of (config / cudnn) over layers:",
        {n: round(v, 1) for n, v in sorted(by_config.items(), key=lambda kv: kv[1])},
    )


if __name__ == "__main__":
    main()
