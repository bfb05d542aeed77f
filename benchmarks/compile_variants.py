"""How many Triton kernel variants a model compiles, and how long a cold optimize() takes over them.

    python -m benchmarks.compile_variants list --models fuser.yolov8n,fuser.resnet50 [--batch 1] [-v]
    python -m benchmarks.compile_variants compile --models fuser.resnet50 --workers 1,2,16
    python -m benchmarks.compile_variants cold --out DIR [--workers 0]          # the GPU run

- ``list`` (CPU or GPU): the distinct compiled variants each model needs on an sm_90 GPU -- kernel,
  constexprs, warps, stages and the arguments Triton specialized (divisible by 16, or an int equal to 1)
  -- computed without a GPU from an interpreter run planned as on that GPU
  (``fuser.kernels.precompile.collecting(simulate=...)``). The pool kernels are not counted there.
- ``compile`` (CPU or GPU): those variants compiled into an empty Triton cache by N worker processes,
  for each N: the wall time of fuser's compile-ahead step alone.
- ``cold`` (GPU): ``fuser.optimize()`` of each row in its own process with empty Triton and fuser caches
  (``optimize_s_cold``: what a new user waits), and what its compile-ahead step did (variants, workers,
  seconds). ``--workers 0`` switches compiling ahead off: the serial figure to compare with.

Models are benchmarks/real_models.py's (ultralytics, torchvision, fuser.models); rows as in gpu_models.py:
batch 1 in float32 (precision tf32) and batch 32 in float16.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

COLD_ROWS = [
    (model, batch, dtype)
    for batch, dtype in ((1, "float32"), (32, "float16"))
    for model in ("yolov8n", "resnet50", "efficientnet_b0", "mobilenet_v3_large")
]


def _precision(dtype: str) -> str:
    return "tf32" if dtype == "float32" else "fp16"


def _prepared(name: str, batch: int, size: int | None, dtype: str, device: str) -> tuple[Any, torch.Tensor]:
    from benchmarks import real_models

    model, x = real_models.build(name, batch, size)
    dt = getattr(torch, dtype)
    model = model.to(device=device, dtype=dt, memory_format=torch.channels_last)
    return model, x.to(device, dt).contiguous(memory_format=torch.channels_last)


def model_variants(name: str, batch: int = 1, size: int | None = None, dtype: str = "float32", arch: str = "sm90"):
    """The kernel variants ``name`` compiles on a GPU of ``arch``, listed on the CPU."""
    import fuser
    from fuser.kernels import precompile

    model, x = _prepared(name, batch, size, dtype, "cpu")
    fused = fuser.optimize(model, (x,), precision=_precision(dtype), backend="interpret", cuda_graphs=False)
    with torch.no_grad(), precompile.collecting(simulate=arch) as variants:
        fused(x)
    return variants


GEOMETRY = ("stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w")


def specialize_geometry() -> None:
    """Let Triton specialize the conv kernels' stride, padding and dilation again (as before they were
    excluded), for the before / after count of ``list --specialize-geometry``."""
    from fuser.kernels import conv, depthwise, direct_conv

    for kernel in (conv._conv2d_act_kernel, depthwise._depthwise_act_kernel, direct_conv._direct_conv_act_kernel):
        for param in kernel.params:
            if param.name in GEOMETRY:
                param.do_not_specialize = False


def _list(args: argparse.Namespace) -> dict[str, Any]:
    if args.specialize_geometry:
        specialize_geometry()
    result: dict[str, Any] = {}
    for name in args.models.split(","):
        start = time.perf_counter()
        variants = model_variants(name, args.batch, args.size, args.dtype, args.arch)
        by_kernel = collections.Counter(v.name for v in variants)
        result[name] = {
            "variants": len(variants),
            "by_kernel": dict(by_kernel),
            "lines": [v.describe() for v in variants],
        }
        print(f"{name} B{args.batch} {args.dtype}: {len(variants)} variants {dict(by_kernel)} "
              f"({time.perf_counter() - start:.0f} s to list)", flush=True)  # fmt: skip
        if args.verbose:
            for line in result[name]["lines"]:
                print("   ", line)
    return result


def _compile(args: argparse.Namespace) -> dict[str, Any]:
    from fuser.kernels import precompile

    variants = [v for name in args.models.split(",") for v in model_variants(name, args.batch, args.size, args.dtype)]
    print(f"{len(variants)} variants", flush=True)
    timings = {}
    for count in (int(n) for n in args.workers.split(",")):
        cache = Path(tempfile.mkdtemp(prefix="compile-variants-"))
        os.environ["TRITON_CACHE_DIR"] = str(cache)
        start = time.perf_counter()
        report = precompile.compile_variants(variants, workers=count, progress=False)
        timings[count] = time.perf_counter() - start
        print(f"  {count} workers: {timings[count]:.1f} s; {dataclasses.asdict(report)}", flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    return {"variants": len(variants), "seconds_by_workers": timings}


def _cold_child(spec: str, out: Path) -> None:
    import fuser
    from fuser.kernels import precompile

    name, batch, dtype = spec.split(":")
    model, x = _prepared(name, int(batch), None, dtype, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    fuser.optimize(model, (x,), precision=_precision(dtype), backend="auto", cuda_graphs=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = precompile.last_report()
    row = {"model": name, "batch": int(batch), "dtype": dtype, "optimize_s_cold": seconds}
    row["compile_ahead"] = dataclasses.asdict(report) if report is not None else None
    out.write_text(json.dumps(row) + "\n")


def _cold(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_models import _cold_env

    rows = []
    for name, batch, dtype in COLD_ROWS:
        root = Path(tempfile.mkdtemp(prefix="compile-variants-row-"))
        env = _cold_env(root)
        if args.workers is not None:
            env["FUSER_COMPILE_WORKERS"] = args.workers
        out = root / "row.json"
        command = [sys.executable, "-m", "benchmarks.compile_variants", "--child", f"{name}:{batch}:{dtype}"]
        command += ["--child-out", str(out)]
        child = subprocess.run(command, env=env, cwd=Path(__file__).parents[1], check=False)
        row = json.loads(out.read_text()) if out.exists() else {"model": name, "batch": batch, "dtype": dtype}
        if child.returncode != 0:
            row["error"] = f"row process exited with code {child.returncode}"
        print(json.dumps(row), flush=True)
        rows.append(row)
        shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "workers_env": args.workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["list", "compile", "cold"])
    parser.add_argument("--models", default="fuser.yolov8n,fuser.resnet50,fuser.efficientnet_b0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, help="input size (default: each model's own)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--arch", default="sm90", help="the GPU architecture to list for")
    parser.add_argument("--workers", help="compile: comma-separated worker counts; cold: FUSER_COMPILE_WORKERS")
    parser.add_argument("-v", "--verbose", action="store_true", help="list: one line per variant")
    parser.add_argument(
        "--specialize-geometry", action="store_true", help="list: with stride, padding and dilation specialized"
    )
    parser.add_argument("--out", type=Path, help="write the result JSON into this folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _cold_child(args.child, args.child_out)
        return
    if args.command is None:
        parser.error("say list, compile or cold")
    if args.command == "cold" and not torch.cuda.is_available():
        raise SystemExit("cold measures optimize() on a CUDA GPU; on the CPU use list or compile")
    if args.command == "compile" and args.workers is None:
        args.workers = "1,2"
    result = {"list": _list, "compile": _compile, "cold": _cold}[args.command](args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        payload = {"benchmark": f"compile_variants {args.command}", "date": now.isoformat(timespec="minutes"),
                   "device": device, "batch": args.batch, "dtype": args.dtype, "result": result}  # fmt: skip
        path = args.out / f"compile-variants-{args.command}-{now.date().isoformat()}.json"
        path.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
