"""CPU benchmark: reference models optimized with the torch backend against eager PyTorch, in one run.

    python -m benchmarks.cpu_models                 # writes benchmarks/results/cpu-models-<date>.{json,png}

On a CPU the fused ops run their torch reference, so the gain is what folding removes (every BatchNorm,
and the bias add, which goes into the conv); the claim checked here is "no slower than eager". Eager and
optimized forwards are interleaved, so load on the machine hits both alike; each figure is a median.
The time of ``fuser.optimize`` itself is measured too (with example inputs: that includes one forward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import fuser
from fuser import models

CASES = [("yolov8n", 1, 640), ("yolov8n", 1, 320), ("resnet50", 1, 224), ("efficientnet_b0", 1, 224)]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def interleaved_medians(a, b, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median ms of a(x) and of b(x), timed alternately after one warm-up call of each."""
    a(x), b(x)
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def run(repeats: int) -> dict:
    rows = []
    for name, batch, size in CASES:
        print(f"[cpu bench] {name} batch {batch} @{size}", flush=True)
        model = models.build(name)
        x = models.example_input(name, batch=batch, size=size)
        optimize_s = []
        for _ in range(3):
            start = time.perf_counter()
            optimized = fuser.optimize(model, (x,), backend="torch")
            optimize_s.append(time.perf_counter() - start)
        with torch.no_grad():
            eager_ms, fused_ms = interleaved_medians(model, optimized, x, repeats)
            reference = models.build(name).double()(x.double())
            out = optimized(x)
        error = ((out.double() - reference).norm() / reference.norm()).item()
        rows.append(
            {
                "model": name,
                "batch": batch,
                "size": size,
                "fused_chains": len(optimized.fusion_report.fused),
                "eager_ms": eager_ms,
                "fused_ms": fused_ms,
                "speedup": eager_ms / fused_ms,
                "optimize_s_first": optimize_s[0],
                "optimize_s_median": statistics.median(optimize_s),
                "rel_error_vs_float64": error,
            }
        )
        print(
            f"  eager {eager_ms:.1f} ms, fused {fused_ms:.1f} ms ({eager_ms / fused_ms:.2f}x), "
            f"optimize {statistics.median(optimize_s):.2f} s, error {error:.1e}",
            flush=True,
        )
    return {
        "benchmark": "cpu_models",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "fuser": fuser.__version__},
        "repeats": repeats,
        "rows": rows,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']}\nB{r['batch']} @{r['size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, [r["speedup"] for r in rows], color="tab:green")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup over eager (x)")
    ax.set_title(f"fuser, torch backend on {result['machine']['cpu']} ({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    lines = [
        "| model | batch, size | fused chains | eager ms | fused ms | speedup | optimize() s | error vs fp64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']}, {r['size']} | {r['fused_chains']} | {r['eager_ms']:.1f} | "
            f"{r['fused_ms']:.1f} | {r['speedup']:.2f}x | {r['optimize_s_median']:.2f} | "
            f"{r['rel_error_vs_float64']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    result = run(args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cpu-models-{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(table(result))
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
