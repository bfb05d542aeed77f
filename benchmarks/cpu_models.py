"""CPU benchmark: reference models optimized with the torch backend against eager PyTorch, in one run.

    python -m benchmarks.cpu_models                 # writes benchmarks/results/cpu-models-<date>.{json,png}
    python -m benchmarks.cpu_models --threads 1 --batch 2 --repeats 9

On a CPU the fused ops run their torch reference, so the gain is what folding removes (every BatchNorm,
and the bias add, which goes into the conv); the claim checked here is "no slower than eager". Eager and
optimized forwards alternate call by call (eager, fused, eager, fused, ...), so load on a shared machine
hits both alike; the figures are medians, and the speedup is given two ways: the ratio of the medians
and the median of the ratios of each adjacent pair (with its quartiles: the spread a reader should
expect). The thread count is set and stated (default one: a shared 2-core machine gives no steady
second core). The time of ``fuser.optimize`` itself is measured too (with example inputs: that includes
one forward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import fuser
from fuser import models
from fuser.runtime.profiling import interleaved_ms

ROOT = Path(__file__).resolve().parents[1]
CASES = [("yolov8n", 640), ("yolov8n", 320), ("resnet50", 224), ("efficientnet_b0", 224)]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


CPU = torch.device("cpu")


def run(repeats: int, batch: int, threads: int, only: list[str] | None = None) -> dict:
    torch.set_num_threads(threads)
    rows = []
    for name, size in CASES:
        if only and name not in only:
            continue
        print(f"[cpu bench] {name} batch {batch} @{size}, {threads} thread(s)", flush=True)
        model = models.build(name)
        x = models.example_input(name, batch=batch, size=size)
        optimize_s = []
        for _ in range(3):
            start = time.perf_counter()
            optimized = fuser.optimize(model, (x,), backend="torch")
            optimize_s.append(time.perf_counter() - start)
        with torch.no_grad():
            times = interleaved_ms({"eager": partial(model, x), "fused": partial(optimized, x)}, CPU, repeats, warmup=1)
            eager_times, fused_times = times["eager"], times["fused"]
            reference = models.build(name).double()(x.double())
            out = optimized(x)
        error = ((out.double() - reference).norm() / reference.norm()).item()
        eager_ms, fused_ms = statistics.median(eager_times), statistics.median(fused_times)
        pairs = [e / f for e, f in zip(eager_times, fused_times, strict=True)]
        quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
        rows.append(
            {
                "model": name,
                "batch": batch,
                "size": size,
                "fused_chains": len(optimized.fusion_report.fused),
                "eager_ms": eager_ms,
                "fused_ms": fused_ms,
                "speedup": eager_ms / fused_ms,
                "speedup_pairwise": statistics.median(pairs),
                "speedup_quartiles": [quartiles[0], quartiles[2]],
                "eager_times_ms": eager_times,
                "fused_times_ms": fused_times,
                "optimize_s_first": optimize_s[0],
                "optimize_s_median": statistics.median(optimize_s),
                "rel_error_vs_float64": error,
            }
        )
        print(
            f"  eager {eager_ms:.1f} ms, fused {fused_ms:.1f} ms ({eager_ms / fused_ms:.2f}x, pairwise "
            f"{statistics.median(pairs):.2f}x [{quartiles[0]:.2f}, {quartiles[2]:.2f}]), "
            f"optimize {statistics.median(optimize_s):.2f} s, error {error:.1e}",
            flush=True,
        )
    return {
        "benchmark": "cpu_models",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "fuser": fuser.__version__, "fuser_commit": commit()},
        "repeats": repeats,
        "method": f"eager and fused called alternately, {repeats} calls each after one warm-up, "
        f"{torch.get_num_threads()} thread(s), batch {batch}",
        "rows": rows,
    }


def commit() -> str | None:
    """The git HEAD beside the sources (gpu_models.git_commit), or None without git."""
    from benchmarks.gpu_models import git_commit

    return git_commit(ROOT)[0]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']}\nB{r['batch']} @{r['size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ys = [r.get("speedup_pairwise", r["speedup"]) for r in rows]
    spread = [r.get("speedup_quartiles", [y, y]) for r, y in zip(rows, ys, strict=True)]
    err = [
        [y - lo for y, (lo, _) in zip(ys, spread, strict=True)],
        [hi - y for y, (_, hi) in zip(ys, spread, strict=True)],
    ]
    ax.bar(labels, ys, yerr=err, capsize=4, color="tab:green")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup over eager (x)")
    threads = result["machine"].get("threads")
    ax.set_title(
        f"fuser, torch backend on {result['machine']['cpu']}, {threads} thread(s) ({result['date']})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    threads = result["machine"].get("threads", "?")
    lines = [
        "| model | batch, size | threads | fused chains | eager ms | fused ms | speedup | pairwise speedup "
        "[quartiles] | optimize() s | error vs fp64 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pairwise = "-"
        if "speedup_pairwise" in r:
            lo, hi = r["speedup_quartiles"]
            pairwise = f"{r['speedup_pairwise']:.2f}x [{lo:.2f}, {hi:.2f}]"
        lines.append(
            f"| {r['model']} | {r['batch']}, {r['size']} | {threads} | {r['fused_chains']} | {r['eager_ms']:.1f} | "
            f"{r['fused_ms']:.1f} | {r['speedup']:.2f}x | {pairwise} | {r['optimize_s_median']:.2f} | "
            f"{r['rel_error_vs_float64']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--repeats", type=int, default=9, help="calls of each model, alternating")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--models", help="comma-separated subset of the cases' models")
    args = parser.parse_args()
    result = run(args.repeats, args.batch, args.threads, args.models.split(",") if args.models else None)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cpu-models-{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(table(result))
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
