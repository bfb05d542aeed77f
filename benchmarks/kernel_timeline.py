"""Every kernel of one forward, in launch order, with the fused module that launched it (GPU).

    python -m benchmarks.kernel_timeline --out DIR --models efficientnet_b0,mobilenet_v3_large

A whole-model profile says which kernel *kind* takes the time (``gpu_models``' ``by_kernel``); this says
which *layer*: each fuser kernel launch is listed with its module, grid, constexprs (tile, VEC, epilogue) and
GPU time, so a slow layer can be rerun alone. The forward runs without CUDA graphs (graph replays hide the
launches from the profiler's correlation); kernel times are the same either way. The models are built as
their libraries build them (benchmarks/real_models.py), untuned (the shipped tile table, else the cost model).
Writes ``timeline-<model>-b<batch>.json`` per model and prints each model's slowest launches last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import real_models


def _record_launches(log: list[dict[str, Any]]):
    """Wrap LaunchOptions.launch (every compiled fuser launch) so each appends its kernel, grid, keyword
    arguments (constexprs, warps, stages) and first tensor shapes to ``log``; returns the undo."""
    from fuser.kernels import launch as launch_mod

    original = launch_mod.LaunchOptions.launch

    def launch(self, kernel, grid, args):
        fn = getattr(kernel, "fn", kernel)
        log.append(
            {
                "kernel": fn.__name__,
                "grid": [int(g) for g in grid],
                "kwargs": {k: v for k, v in self.kwargs.items() if isinstance(v, (int, float, bool, str))},
                "shapes": [list(a.shape) for a in args if isinstance(a, torch.Tensor)][:2],
            }
        )
        return original(self, kernel, grid, args)

    launch_mod.LaunchOptions.launch = launch
    return lambda: setattr(launch_mod.LaunchOptions, "launch", original)


def _gpu_kernels(trace_path: Path) -> list[dict[str, Any]]:
    """The chrome trace's kernel events in start order: name, microseconds, grid, block, registers."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e["ts"])
    return [
        {
            "name": e["name"],
            "us": float(e.get("dur", 0.0)),
            "grid": e.get("args", {}).get("grid"),
            "block": e.get("args", {}).get("block"),
            "registers": e.get("args", {}).get("registers per thread"),
        }
        for e in kernels
    ]


def timeline(name: str, batch: int, dtype: str, out: Path) -> dict[str, Any]:
    import fuser

    model, x = real_models.build(name, batch)
    torch_dtype = getattr(torch, dtype)
    model = model.to("cuda", torch_dtype, memory_format=torch.channels_last)
    x = x.to("cuda", torch_dtype).contiguous(memory_format=torch.channels_last)
    precision = "tf32" if dtype == "float32" else {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    with torch.no_grad():
        fused = fuser.optimize(model, (x,), precision=precision, cuda_graphs=False)
        for _ in range(3):
            fused(x)
        torch.cuda.synchronize()
        log: list[dict[str, Any]] = []
        restore = _record_launches(log)
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                fused(x)
                torch.cuda.synchronize()
        finally:
            restore()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        kernels = _gpu_kernels(trace)
    # fuser's launches through LaunchOptions, in order, are the trace's kernels of the same names (kernels
    # launched otherwise, such as the channel mean's, have no entry in the log and are skipped over).
    pending = list(reversed(log))
    rows = []
    for k in kernels:
        row = dict(k)
        if pending and pending[-1]["kernel"] == k["name"]:
            row["fuser"] = pending.pop()
        rows.append(row)
    result = {"model": name, "batch": batch, "dtype": dtype, "kernels": rows, "fuser_launches": len(log)}
    (out / f"timeline-{name}-b{batch}-{dtype}.json").write_text(json.dumps(result, indent=1))
    return result


def summary(result: dict[str, Any], top: int) -> str:
    rows = result["kernels"]
    total = sum(r["us"] for r in rows)
    lines = [f"## {result['model']} batch {result['batch']} {result['dtype']}: {len(rows)} kernels, {total:.1f} us"]
    for r in sorted(rows, key=lambda r: -r["us"])[:top]:
        f = r.get("fuser", {})
        c = f.get("kwargs", {})
        names = ("KH", "KW", "VEC", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "PROLOGUE")
        keep = {k: c[k] for k in names if k in c}
        lines.append(
            f"{r['us']:7.1f} us  {r['name'][:40]:40s} grid={r['grid']} block={r['block']} "
            f"shapes={f.get('shapes')} {keep} warps={c.get('num_warps')} stages={c.get('num_stages')}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--models", default="efficientnet_b0,mobilenet_v3_large")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = []
    for name in args.models.split(","):
        try:
            texts.append(summary(timeline(name, args.batch, args.dtype, args.out), args.top))
        except Exception as e:  # one model's failure must not hide the others'
            texts.append(f"## {name}: failed: {type(e).__name__}: {e}")
    print("\n\n".join(texts))


if __name__ == "__main__":
    main()
