"""What the fused activation costs inside a conv kernel: each layer's fused conv -> BN -> act timed with no
activation, ReLU and SiLU, same tile, same run.

kernels/NOTES.md version 18 found the fp16 RGB stem issue-bound under Nsight Compute (74% of scheduler cycles
issue) and, counting its compiled instructions, a third of them in the SiLU epilogue (about 12 per output:
``ex2.approx`` and ``div.full`` without flush-to-zero each get range fix-ups). Timing the same kernel with a cheaper
or no activation says how much of that is time on the card, layer by layer, before anyone rewrites the epilogue.

    python -m benchmarks.epilogue_cost --out DIR [--layers NAME,...] [--dtypes fp16,fp32] [--batch 32]

Writes ``DIR/epilogue-cost-<date>.json`` (each row: layer, dtype, batch, the tile of each launch, ms per
activation, SiLU over none) and prints a table last. GPU only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch

from benchmarks.layers import bench_all
from benchmarks.stall_profile import LAYERS, first_call_tiles, fused_layer

DEFAULT_LAYERS = (
    "yolo 3->16 3x3 s2 @640",
    "yolo 64->64 3x3 s1 @80",
    "yolo 128->128 1x1 s1 @40",
    "effnet 144->24 1x1 @56",
    "effnet dw 144 3x3 @56",
    "resnet 512->512 3x3 @7",
)
ACTS = ("NONE", "RELU", "SILU")


def measure(name: str, dtype_name: str, batch: int) -> dict:
    """One row: ``name``'s fused layer with each of :data:`ACTS`, timed interleaved (:func:`bench_all`)."""
    calls, tiles = {}, {}
    for act in ACTS:
        torch.manual_seed(0)  # the same weights and input for every activation
        call, *_ = fused_layer(LAYERS[name], dtype_name, batch, act=act)
        tiles[act] = [str(config) for _, config in first_call_tiles(call)[1]]
        calls[act] = call
    ms = bench_all(calls, rounds=3)
    return {
        "layer": name,
        "dtype": dtype_name,
        "batch": batch,
        "tiles": tiles,
        "ms": ms,
        "silu_over_none": ms["SILU"] / ms["NONE"],
        "relu_over_none": ms["RELU"] / ms["NONE"],
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'layer':30s} {'dtype':5s} {'none us':>8s} {'relu us':>8s} {'silu us':>8s} {'silu/none':>9s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layer']:30s} {r['dtype']:5s} {r['error'][:60]}")
            continue
        us = {act: 1000 * r["ms"][act] for act in ACTS}
        lines.append(f"{r['layer']:30s} {r['dtype']:5s} {us['NONE']:8.1f} {us['RELU']:8.1f} {us['SILU']:8.1f} "
                     f"{r['silu_over_none']:9.3f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", default=",".join(DEFAULT_LAYERS), help="layers.py conv rows, comma-separated")
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    names = [n for n in args.layers.split(",") if n]
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        parser.error(f"unknown layers {unknown}; known: {sorted(LAYERS)}")
    import triton

    date = dt.date.today().isoformat()
    result = {"date": date, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda, "method": __doc__.strip().splitlines()[:6],
              "rows": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"epilogue-cost-{date}.json"
    for name in names:
        for dtype_name in args.dtypes.split(","):
            try:
                row = measure(name, dtype_name, args.batch)
            except Exception as err:  # one failing row must not lose the others
                row = {"layer": name, "dtype": dtype_name, "batch": args.batch,
                       "error": f"{type(err).__name__}: {err}"[:500]}  # fmt: skip
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=1))
            print(table([row]).splitlines()[-1], flush=True)
    print(path)
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
