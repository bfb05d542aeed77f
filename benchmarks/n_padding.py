"""What padding the output channels to a power of two costs the implicit GEMM: YOLOv8n's detect-head 3x3 conv on
80 input channels @80x80, its output channels 64, 80 and 128, each on the same flat-K tile but for the tile's N
(64 channels: BLOCK_N 64; 80 and 128: BLOCK_N 128), same run, interleaved.

kernels/NOTES.md version 21: the head's 80->80 at batch 32 in tf32 runs at 0.75x cuDNN folded + act, and its
tile computes 128 output channels for 80. If 80 costs what 128 costs and 64 much less, splitting N into 64 + 16
(two dots sharing the A tile) would pay; if 64 costs about what 80 does, the padding is not what the time is spent
on.

    python -m benchmarks.n_padding --out DIR [--batch 32] [--dtypes fp32,fp16]

Writes ``DIR/n-padding-<date>.json`` (each row: dtype, C_out, the tile, ms, relative error against float64) and
prints a table last. GPU only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.layers import ConvLayer, bench_all, conv_block, fold_bn
from benchmarks.stall_profile import DTYPES

C_IN, SIZE = 80, 80
C_OUTS = (64, 80, 128)


def measure(dtype_name: str, batch: int) -> list[dict]:
    """One row per output channel count: the fused conv -> SiLU on a forced flat-K tile of BLOCK_N = C_out rounded
    up to a power of two, timed interleaved with the others (:func:`bench_all`), checked against float64."""
    from fuser.kernels import Activation, Epilogue, conv2d_act, pack_conv_weight
    from fuser.kernels.tile_config import TileConfig

    dtype, precision = DTYPES[dtype_name]
    torch.manual_seed(0)
    x = torch.randn(batch, C_IN, SIZE, SIZE, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    calls, checks, tiles = {}, {}, {}
    for c_out in C_OUTS:
        with torch.no_grad():
            w64, b64 = fold_bn(conv_block(ConvLayer(f"head 80->{c_out}", C_IN, c_out, 3, 1, SIZE), torch.float32))
        packed, bias = pack_conv_weight(w64.float(), precision), b64.float()
        tile = TileConfig(128, 64 if c_out <= 64 else 128, 64, 8, 8, 3)
        tiles[c_out] = str(tile)

        def call(packed=packed, bias=bias, tile=tile) -> torch.Tensor:
            with torch.no_grad():
                return conv2d_act(x, packed, bias, stride=1, padding=1, epilogue=Epilogue(Activation.SILU), tile=tile)

        calls[c_out] = call
        checks[c_out] = (w64, b64)
    ms = bench_all(calls, rounds=3)
    rows = []
    for c_out in C_OUTS:
        w64, b64 = checks[c_out]
        ref = F.silu(F.conv2d(x.double(), w64, b64, padding=1))
        err = float((calls[c_out]().double() - ref).norm() / ref.norm())
        rows.append({"dtype": dtype_name, "batch": batch, "c_out": c_out, "tile": tiles[c_out], "ms": ms[c_out],
                     "rel_error": err})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'dtype':5s} {'C_out':>5s} {'us':>8s} {'us/ch':>7s} {'err':>8s}  tile"]
    for r in rows:
        lines.append(f"{r['dtype']:5s} {r['c_out']:5d} {1000 * r['ms']:8.1f} {1000 * r['ms'] / r['c_out']:7.2f} "
                     f"{r['rel_error']:8.1e}  {r['tile']}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtypes", default="fp32,fp16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    import triton

    date = dt.date.today().isoformat()
    result = {"benchmark": "n_padding", "date": date, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda, "method": __doc__.strip().splitlines()[:3],
              "rows": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"n-padding-{date}.json"
    for dtype_name in args.dtypes.split(","):
        result["rows"] += measure(dtype_name, args.batch)
        path.write_text(json.dumps(result, indent=1))
    print(path)
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
