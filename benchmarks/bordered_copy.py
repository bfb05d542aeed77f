"""The zero-bordered copy that shifted-tap conv tiles read (kernels/bordered_copy.py), against the same copy
done with torch ops (GPU).

    python -m benchmarks.bordered_copy --out DIR    write DIR/bordered-copy-<date>.json, print a table

For the images of at most 32x32 pixels that get shifted twins (3x3, stride 1: YOLOv8n's 20x20 and ResNet's
28x28, 14x14 and 7x7 stages) at batch 32 and 8, in fp32 and fp16: the one-launch kernel, and the three torch ops
it replaced (two border fills and a strided copy into the interior), each a CUDA-graph replay median (best of two
interleaved rounds), with the bandwidth its bytes imply (the input read once, the buffer written once), and
whether the kernel's buffer equals the torch ops' exactly.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from benchmarks.layers import DTYPES, bench_all

# (channels, image size): the shifted-tap stages of YOLOv8n and ResNet-50.
STAGES = [(256, 20), (512, 7), (256, 14), (128, 28)]


def torch_ops_copy(x: torch.Tensor, top: int, left: int) -> torch.Tensor:
    """The copy as the shifted tiles first did it: an empty buffer, its borders filled, the interior copied."""
    n, c, h, w = x.shape
    out = x.new_empty((n, h + top, w + left, c))
    out[:, :top].zero_()
    out[:, top:, :left].zero_()
    out[:, top:, left:] = x.permute(0, 2, 3, 1)
    return out.view(n * (h + top) * (w + left), c)


def stage_row(channels: int, size: int, batch: int, dtype_name: str) -> dict:
    from fuser.kernels.bordered_copy import bordered_copy

    x = (torch.randn(batch, channels, size, size, device="cuda") + 2.0).to(DTYPES[dtype_name])
    x = x.contiguous(memory_format=torch.channels_last)
    times = bench_all({"kernel": lambda: bordered_copy(x, 1, 1), "torch ops": lambda: torch_ops_copy(x, 1, 1)})
    moved = x.numel() * x.element_size() + batch * (size + 1) ** 2 * channels * x.element_size()
    return {
        "channels": channels,
        "size": size,
        "batch": batch,
        "dtype": dtype_name,
        "ms": times,
        "gb_per_s": {name: moved / (ms * 1e-3) / 1e9 for name, ms in times.items()},
        "equal": bool(torch.equal(bordered_copy(x, 1, 1), torch_ops_copy(x, 1, 1))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bordered_copy: needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.gpu_models import versions

    result = {
        "benchmark": "bordered_copy",
        "date": dt.date.today().isoformat(),
        "card": torch.cuda.get_device_name(),
        "versions": versions(),
        "method": "CUDA-graph replay medians (benchmarks.layers.bench_all), best of two interleaved rounds",
        "rows": [],
    }
    for batch in (32, 8):
        for dtype_name in ("fp32", "fp16"):
            for channels, size in STAGES:
                row = stage_row(channels, size, batch, dtype_name)
                result["rows"].append(row)
                ms, bw = row["ms"], row["gb_per_s"]
                print(f"{channels:4d}@{size:<3d} b{batch:<3d}{dtype_name:5s} kernel {ms['kernel'] * 1e3:6.1f} us "
                      f"({bw['kernel']:5.0f} GB/s)  torch ops {ms['torch ops'] * 1e3:6.1f} us ({bw['torch ops']:5.0f} "
                      f"GB/s)  equal {row['equal']}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bordered-copy-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
