"""The demo (`make demo`): optimize a bundled model on the best device present and show what happened.

Prints the fusion report, ``fuser.verify``'s check against a float64 run of the original (output error,
labels or boxes, every fused layer), kernel launches before/after, and the time per forward before/after
(on a GPU also with CUDA graphs on both sides); draws the error of every fused layer to out/ as a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import fuser
from fuser import models
from fuser.lower import path_choice
from fuser.runtime.cuda_graphs import GraphReplay
from fuser.runtime.profiling import count_launches, interleaved_ms, pairwise_ratio


def _step(text: str) -> None:
    print(f"[fuser demo] {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuser.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="yolov8n", choices=list(models.MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, default=None, help="image size (default: the model's usual size)")
    parser.add_argument("--precision", default="tf32")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA GPU found)"
    _step(f"device: {where}; torch {torch.__version__}")
    _step(f"building {args.model} ({models.MODELS[args.model].description}) with random weights")
    model = models.build(args.model).to(device)
    x = models.example_input(args.model, batch=args.batch, size=args.size).to(device)
    _step(f"input {tuple(x.shape)}; optimizing (precision {args.precision}, backend auto)")

    start = time.perf_counter()
    optimized = fuser.optimize(model, (x,), precision=args.precision, cuda_graphs=False)  # graphs timed below
    optimize_s = time.perf_counter() - start
    print()
    print(optimized.fusion_report)
    print()

    _step("fuser.verify: checking against a float64 run of the original model, layer by layer")
    check = fuser.verify(model, optimized, (x,))
    print()
    print(check)
    print()

    _step("counting kernel launches" if device.type == "cuda" else "counting aten ops (CPU: no kernels)")
    with torch.no_grad():
        launches_before = count_launches(lambda: model(x), device)
        launches_after = count_launches(lambda: optimized(x), device)

    repeats = 50 if device.type == "cuda" else 10
    _step(f"timing {repeats} forwards of each, eager and fused in turn (median)")
    timed = {"eager": lambda: model(x), "fused": lambda: optimized(x)}
    if device.type == "cuda":  # batch 1 is launch-bound: compare both with their launches recorded once
        graphed = fuser.OptimizedModule(
            optimized.module, optimized.fusion_report, optimized.precision, optimized.backend, cuda_graphs=True
        )
        eager_graph = GraphReplay(model)
        timed |= {"eager graphed": lambda: eager_graph(x), "fused graphed": lambda: graphed(x)}
    with torch.no_grad():
        times = interleaved_ms(timed, device, repeats)
    ms = {name: statistics.median(t) for name, t in times.items()}
    speedup = pairwise_ratio(times["eager"], times["fused"])
    graphs_ms = {side: ms[f"{side} graphed"] for side in ("eager", "fused") if f"{side} graphed" in ms}

    unit = "kernel launches" if device.type == "cuda" else "aten ops executed"
    chosen = [c for c, _, _ in path_choice.choices().values()]
    print()
    print(f"  optimize() took        {optimize_s:8.2f} s")
    print(f"  {unit:<22} {launches_before:8d} -> {launches_after:d}")
    print(f"  rel. error vs float64  {check.rel_error:8.1e}  (eager float32: {check.baseline_error:.1e})")
    worst = max(check.layers, key=lambda c: c.rel_error, default=None)
    if worst is not None:
        print(f"  worst fused layer      {worst.rel_error:8.1e}  ({worst.source}: {worst.ops})")
    print(f"  time per forward       {ms['eager']:8.2f} ms eager -> {ms['fused']:.2f} ms fused ({speedup:.2f}x)")
    if graphs_ms:
        print(
            f"  with CUDA graphs       {graphs_ms['eager']:8.2f} ms eager -> {graphs_ms['fused']:.2f} ms fused "
            f"({pairwise_ratio(times['eager graphed'], times['fused graphed']):.2f}x; "
            "fuser.optimize(..., cuda_graphs=True))"
        )
    if device.type == "cpu":
        print("  (on the CPU the fused ops run their torch reference: the gain is only what folding removes)")
    if chosen:
        print(
            f"  measured per layer     {chosen.count(path_choice.KERNEL)} fused Triton kernels, "
            f"{chosen.count(path_choice.LIBRARY)} cuDNN/cuBLAS on folded weights (backend measured)"
        )

    tag = f"demo-{args.model}-{device.type}"
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": args.model,
        "device": where,
        "input": list(x.shape),
        "precision": args.precision,
        "fused": len(optimized.fusion_report.fused),
        "rejected": len(optimized.fusion_report.rejected),
        "optimize_s": optimize_s,
        "launches": [launches_before, launches_after],
        "rel_error": check.rel_error,
        "verify": check.to_dict(),
        "eager_ms": ms["eager"],
        "fused_ms": ms["fused"],
        "speedup_pairwise": speedup,
        "cuda_graphs_ms": graphs_ms,
    }
    (args.out / f"{tag}.json").write_text(json.dumps(summary, indent=2))
    title = f"{args.model} on {where}: error of each fused layer ({args.precision})"
    try:
        plot = check.plot(args.out / f"{tag}-layer-error.png", title)
        print(f"  per-layer error plot   {plot}")
    except ImportError:
        print("  per-layer error plot   not drawn: matplotlib is not installed (pip install 'fuser[plot]')")
    print(f"  full results           {args.out / f'{tag}.json'}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
