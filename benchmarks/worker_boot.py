"""Where a compile worker's start goes: the seconds from making ``fuser.kernels.precompile.Workers`` to each
worker being ready, by boot step, for each way of starting them (``FUSER_COMPILE_START``: a fork of the
calling process, or a fresh interpreter that imports torch and the kernels), each in a fresh process with an
empty Triton cache, as a cold optimize() meets them; then the largest imports of a fresh interpreter's
``import fuser.kernels`` (``python -X importtime``), which is what ``spawn`` waits for.

    python -m benchmarks.worker_boot --out DIR        # ~20 s, on the GPU machine or here

Writes ``worker-boot-<date>.json`` under ``--out`` and prints a short table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STARTS = ("fork", "spawn")

# In the measured process: CUDA started first where there is a GPU (as optimize() finds it: the model is on
# the device), then the pool made twice (the second finds Triton's key warmed in this process).
_CHILD = """
import json, time
import torch
if torch.cuda.is_available():
    torch.ones(1, device="cuda").sum().item()
from fuser.kernels import precompile
runs = []
for _ in range(2):
    workers = precompile.Workers()
    for worker in workers._workers:
        worker.wait_ready()
    last = max(workers._workers, key=lambda w: w.ready_at)
    runs.append({
        "start": precompile.start_method(),
        "workers": len(workers._workers),
        "ready_s": sorted(round(w.ready_at - workers._born, 3) for w in workers._workers),
        "boot_s": {step: round(at - workers._born, 3) for step, at in last.boot.items()},
    })
    workers.close()
print(json.dumps(runs))
"""


def boot(start: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """The two pools' ready times and boot steps in a fresh process whose workers start as ``start``."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**env, "FUSER_COMPILE_START": start}, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {start} run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importtime(env: dict[str, str], top: int = 15) -> list[tuple[str, float]]:
    """A fresh interpreter's imports of the kernels with the largest cumulative seconds."""
    code = "import fuser.kernels.precompile, fuser.kernels"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True)
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((parts[2].rstrip(), int(parts[1]) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "cores": len(os.sched_getaffinity(0))}
    for start in STARTS:
        with tempfile.TemporaryDirectory() as cache:
            result[start] = boot(start, {**os.environ, "TRITON_CACHE_DIR": cache, "FUSER_CACHE_DIR": cache})
    result["importtime"] = importtime({**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"worker-boot-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for start in STARTS:
        for i, run in enumerate(result[start]):
            steps = " ".join(f"{k} {v:.2f}" for k, v in run["boot_s"].items())
            print(f"{start} pool {i + 1}: {run['workers']} workers, last ready {max(run['ready_s']):.2f} s | {steps}")
    for name, seconds in result["importtime"][:10]:
        print(f"  import {seconds:6.2f} s {name.strip()}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
