"""Whole-model GPU benchmark: fuser against eager PyTorch and torch.compile, in one run (ANCHORS.md's table).

    python -m benchmarks.gpu_models --out DIR [--compile] [--quick]
    python -m benchmarks.gpu_models --table RESULTS.json
    python -m benchmarks.gpu_models --plot RESULTS.json PNG     speedup of every variant over eager

Rows: YOLOv8n-shaped @640, EfficientNet-B0 @224, ResNet-50 @224, each at batch 1 in float32 and batch 32 in
float16, channels_last inputs. Variants: eager (cudnn.benchmark on, TF32 allowed); fuser as optimize() gives it
(backend "auto": the fused Triton kernels); fuser with backend "measured" (per layer the faster of the fused
kernel and cuDNN/cuBLAS on the folded weights, timed on the first call); eager and fuser "auto" each with
CUDA graphs (fuser.cuda_graphs), since batch 1 is launch-bound and a fair comparison records both sides'
launches once; and with --compile torch.compile (freezing on) in its default mode and in
mode="reduce-overhead" (CUDA graphs). Precision tf32 for float32 models and fp16 for float16 ones. Each time is
a median of CUDA-event timings after warm-up; the error of each variant against a float64 run of the model on
the GPU is recorded. torch.compile costs 10-25 s of compile time per model and mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import torch

import fuser
from fuser import models, path_choice
from fuser.cuda_graphs import GraphReplay
from fuser.profiling import count_launches, median_ms

# In the order they are measured: a run cut short by --budget-s keeps the first ones.
ROWS = [
    ("yolov8n", 1, 640, torch.float32),
    ("resnet50", 1, 224, torch.float32),
    ("yolov8n", 32, 640, torch.float16),
    ("efficientnet_b0", 1, 224, torch.float32),
    ("resnet50", 32, 224, torch.float16),
    ("efficientnet_b0", 32, 224, torch.float16),
]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_row(name: str, batch: int, size: int, dtype: torch.dtype, compile_modes: list[str], repeats: int) -> dict:
    device = torch.device("cuda")
    model = models.build(name).to(device=device, memory_format=torch.channels_last)
    x = models.example_input(name, batch=batch, size=size).to(device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        reference = models.build(name).to(device).double()(x.double())
    model, x = model.to(dtype), x.to(dtype)
    precision = "tf32" if dtype == torch.float32 else "fp16"
    variants: dict[str, Any] = {"eager": model}
    path_choice.clear()
    start = time.perf_counter()
    fused = fuser.optimize(model, (x,), precision=precision, cuda_graphs=False)  # "auto": Triton kernels on CUDA
    optimize_s = time.perf_counter() - start
    variants["fuser"] = fused
    variants["fuser measured"] = fuser.optimize(model, (x,), precision=precision, backend="measured", cuda_graphs=False)
    variants["eager+cuda_graphs"] = GraphReplay(model)
    variants["fuser+cuda_graphs"] = fuser.OptimizedModule(
        fused.module, fused.fusion_report, fused.precision, fused.backend, cuda_graphs=True
    )
    chosen = [c for c, _, _ in path_choice.choices().values()]
    compile_s = {}
    for mode in compile_modes:
        torch._inductor.config.freezing = True
        compiled = torch.compile(model, mode=None if mode == "default" else mode)
        start = time.perf_counter()
        with torch.no_grad():
            compiled(x)
            compiled(x)
        compile_s[mode] = time.perf_counter() - start
        variants[f"torch.compile {mode}"] = compiled
    row: dict[str, Any] = {
        "model": name,
        "batch": batch,
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "precision": precision,
        "fused_chains": len(variants["fuser"].fusion_report.fused),
        "optimize_s": optimize_s,
        "measured_chose_kernel": chosen.count(path_choice.KERNEL),
        "measured_chose_library": chosen.count(path_choice.LIBRARY),
        "compile_s": compile_s,
        "ms": {},
        "rel_error": {},
        "launches": {},
    }
    with torch.no_grad():
        for label, fn in variants.items():
            row["ms"][label] = median_ms(lambda fn=fn: fn(x), device, repeats=repeats, warmup=3)
            row["rel_error"][label] = _rel(fn(x), reference)
            if not label.startswith("torch.compile") and "graphs" not in label:
                row["launches"][label] = count_launches(lambda fn=fn: fn(x), device)
    eager = row["ms"]["eager"]
    row["speedup_vs_eager"] = {k: eager / v for k, v in row["ms"].items()}
    print(f"{name} B{batch} {row['dtype']}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()), flush=True)
    return row


def _ratio(ms: dict[str, float], base: str, new: str) -> str:
    return f"{ms[base] / ms[new]:.2f}x" if base in ms and new in ms else "-"


def table(result: dict) -> str:
    labels = list(dict.fromkeys(k for r in result["rows"] for k in r["ms"]))
    head = (
        "| model | B, size, dtype | chains | "
        + " | ".join(f"{k} ms" for k in labels)
        + " | fuser vs eager | both with CUDA graphs |"
    )
    lines = [head, "|" + "---|" * (len(labels) + 5)]
    for r in result["rows"]:
        ms = r["ms"]
        cells = " | ".join(f"{ms[k]:.3f}" if k in ms else "-" for k in labels)
        lines.append(
            f"| {r['model']} | {r['batch']}, {r['size']}, {r['dtype']} | {r['fused_chains']} | {cells} | "
            f"{_ratio(ms, 'eager', 'fuser')} | {_ratio(ms, 'eager+cuda_graphs', 'fuser+cuda_graphs')} |"
        )
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    """Grouped bars: each variant's speedup over eager (log scale), one group per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["rows"]
    labels = [k for k in dict.fromkeys(k for r in rows for k in r["ms"]) if k != "eager"]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 3.8))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["ms"]["eager"] / r["ms"][label] if label in r["ms"] else 0.0 for r in rows]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(range(len(rows)), [f"{r['model']}\nB{r['batch']} {r['dtype']}" for r in rows], fontsize=8)
    ax.set_ylabel("speedup over eager (x)")
    ax.set_title(f"whole models on {result['card']} ({result['date']})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (default, reduce-overhead)")
    parser.add_argument("--quick", action="store_true", help="batch-1 rows only, fewer repeats")
    parser.add_argument("--model", action="append", choices=sorted({r[0] for r in ROWS}), help="only these models")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results JSON and exit")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("RESULTS", "PNG"), help="write the speedup plot")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no new row after this long")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = [r for r in ROWS if (not args.quick or r[1] == 1) and (not args.model or r[0] in args.model)]
    modes = ["default", "reduce-overhead"] if args.compile else []
    result: dict[str, Any] = {
        "benchmark": "gpu_models",
        "date": datetime.date.today().isoformat(),
        "card": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__,
        },
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-models-{result['date']}.json"
    start = time.perf_counter()
    for i, r in enumerate(rows):
        if time.perf_counter() - start > args.budget_s:
            result["left_out"] = [f"{m} B{b} {str(d).removeprefix('torch.')}" for m, b, _, d in rows[i:]]
            print(f"budget of {args.budget_s:.0f} s spent: left out {', '.join(result['left_out'])}", flush=True)
            break
        result["rows"].append(run_row(*r, compile_modes=modes, repeats=20 if args.quick else 50))
        path.write_text(json.dumps(result, indent=2) + "\n")  # after every row: a run cut short keeps its rows
    print(table(result))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and .png")


if __name__ == "__main__":
    main()
