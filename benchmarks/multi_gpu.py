"""Data-parallel batch inference of an optimized model with torch.distributed, one process per device.

    python -m benchmarks.multi_gpu --out DIR                        # every GPU, one process each (NCCL)
    python -m benchmarks.multi_gpu --out DIR --procs-per-gpu 2      # two processes sharing each GPU
    python -m benchmarks.multi_gpu --out DIR --device cpu --quick   # two gloo processes on the CPU

What a user who outgrows one GPU does: the model is optimized once and saved (``torch.save``), every rank
loads that file (``torch.load``) and moves it to its own device (``.to(f"cuda:{i}")``), and the ranks
split a synthetic dataset (batch ``b`` of it is random data seeded by ``b``, so every run sees the same
images) round-robin by batch. Each rank checks that every parameter and buffer of its copy is on its
device, runs one warm-up batch (kernels compiled, CUDA graphs recorded on its device), then the ranks
start together; images per second is the dataset's size over the slowest rank's time. The outputs of
every batch are hashed (their exact bytes) and gathered on rank 0, and compared with a one-process run
of the same saved model in the same invocation: ``outputs_equal`` means identical bits.

Results: ``benchmarks/results/multi-gpu-<date>.json``, one row per run with ``model``, ``device``,
``gpus`` (processes), ``images_per_s``, ``scaling`` (against one process in the same invocation) and
``outputs_equal``. NCCL cannot put two ranks on one GPU, so with ``--procs-per-gpu`` above 1 the ranks
talk through gloo (the collectives here carry only timings and hashes). NVLink multicast is kept off
in every process (NCCL_NVLS_ENABLE=0 and the like): on shared hosts it can take GPUs out of service.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_leaves

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def batch_input(index: int, batch: int, size: int, seed: int = 0) -> torch.Tensor:
    """Batch ``index`` of the synthetic dataset: the same images in every run and every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(batch, 3, size, size, generator=generator)


def output_digest(out: Any) -> str:
    """SHA-256 of the exact bytes of every tensor in an output (tuples and dicts included)."""
    digest = hashlib.sha256()
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: dict[str, Any]) -> None:
    os.environ.update(NO_MULTICAST)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    world = cfg["procs"]
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank % cfg["gpus"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(cfg["backend"], rank=rank, world_size=world)
    try:
        dtype = getattr(torch, cfg["dtype"])
        model = torch.load(cfg["model_path"], weights_only=False, map_location="cpu").to(device)
        on_device = all(t.device == device for t in model.state_dict().values() if isinstance(t, torch.Tensor))
        mine = list(range(rank, cfg["batches"], world))
        inputs = {
            b: batch_input(b, cfg["batch"], cfg["size"], cfg["seed"])
            .to(device, dtype)
            .contiguous(memory_format=torch.channels_last)
            for b in mine
        }
        outputs: dict[int, Any] = {}
        with torch.no_grad():
            if mine:  # warm-up: kernels compiled, CUDA graphs recorded, on this rank's device
                model(inputs[mine[0]])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(cfg["passes"]):
                for b in mine:
                    outputs[b] = model(inputs[b])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        kept = outputs if cfg["keep_outputs"] else {}
        local = {
            "rank": rank,
            "device": str(device),
            "elapsed_s": elapsed,
            "on_device": on_device,
            "digests": {b: output_digest(o) for b, o in outputs.items()},
            "outputs": {
                b: tuple(t.cpu() for t in tree_leaves(o) if isinstance(t, torch.Tensor)) for b, o in kept.items()
            },
        }
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(local, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            torch.save(gathered, cfg["result_path"])
    finally:
        dist.destroy_process_group()


def run_data_parallel(
    model_path: Path,
    *,
    device: str,
    procs: int,
    gpus: int = 1,
    batches: int,
    batch: int,
    size: int,
    dtype: str = "float32",
    seed: int = 0,
    threads: int | None = None,
    backend: str | None = None,
    keep_outputs: bool = False,
    passes: int = 1,
) -> dict[str, Any]:
    """Run the saved model ``passes`` times over ``batches`` batches split across ``procs`` processes.

    Returns ``images_per_s`` (all images of all passes over the slowest rank's time), ``digests`` (batch index ->
    SHA-256 of its output), ``on_device`` (every rank's copy wholly on its device), ``backend`` and,
    with ``keep_outputs``, ``outputs`` (batch index -> its output tensors, on the CPU).
    """
    if backend is None:
        backend = "nccl" if device == "cuda" and procs <= gpus else "gloo"
    os.environ.update(NO_MULTICAST)  # inherited by the spawned processes too
    with tempfile.TemporaryDirectory(prefix="multi-gpu-") as tmp:
        result_path = Path(tmp) / "gathered.pt"
        cfg = {
            "model_path": str(model_path),
            "result_path": str(result_path),
            "device": device,
            "procs": procs,
            "gpus": gpus,
            "batches": batches,
            "batch": batch,
            "size": size,
            "dtype": dtype,
            "seed": seed,
            "threads": threads,
            "backend": backend,
            "keep_outputs": keep_outputs,
            "passes": passes,
            "port": _free_port(),
        }
        mp.spawn(_worker, args=(cfg,), nprocs=procs, join=True)
        gathered = torch.load(result_path, weights_only=False)
    slowest = max(g["elapsed_s"] for g in gathered)
    merged: dict[str, Any] = {
        "backend": backend,
        "elapsed_s": slowest,
        "images_per_s": passes * batches * batch / slowest,
        "on_device": all(g["on_device"] for g in gathered),
        "rank_devices": [g["device"] for g in gathered],
        "digests": {b: d for g in gathered for b, d in g["digests"].items()},
    }
    if keep_outputs:
        merged["outputs"] = {b: o for g in gathered for b, o in g["outputs"].items()}
    return merged


def save_optimized(
    name: str, size: int, dtype: str, path: Path, cuda_graphs: bool, optimize_on: str = "cpu"
) -> dict[str, Any]:
    """Build ``name`` (benchmarks/real_models.py), optimize it on ``optimize_on`` ("cpu", or "cuda": GPU 0,
    kernels compiled there, as a user who optimizes on one GPU and serves on all would), and
    ``torch.save`` it to ``path``."""
    import fuser
    from benchmarks import real_models

    device = torch.device("cuda", 0) if optimize_on == "cuda" else torch.device("cpu")
    model, _ = real_models.build(name, 1, size)
    model = model.to(device, getattr(torch, dtype)).to(memory_format=torch.channels_last)
    example = torch.randn(1, 3, size, size).to(device, getattr(torch, dtype))
    example = example.contiguous(memory_format=torch.channels_last)
    kwargs: dict[str, Any] = {"precision": "tf32" if dtype == "float32" else "fp16", "backend": "auto"}
    kwargs["cuda_graphs"] = cuda_graphs
    if "tune" in inspect.signature(fuser.optimize).parameters:
        kwargs["tune"] = False  # the same tile choices in every process: identical outputs
    start = time.perf_counter()
    optimized = fuser.optimize(model, (example,), **kwargs)
    optimize_s = time.perf_counter() - start
    torch.save(optimized, path)
    info = {"fused_chains": len(optimized.fusion_report.fused), "optimize_s": optimize_s, "optimize_kwargs": kwargs}
    return info | {"optimized_on": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--models", default="yolov8n,resnet50", help="comma-separated, from benchmarks/real_models.py")
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all)")
    parser.add_argument("--procs-per-gpu", type=int, default=1, help="processes sharing each GPU")
    parser.add_argument("--procs", type=int, default=2, help="CPU: processes of the N-process run")
    parser.add_argument("--images", type=int, default=1024, help="images in the synthetic dataset")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, help="input size (default: each model's own)")
    parser.add_argument("--dtype", help="default: float16 on CUDA, float32 on the CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="optimize with cuda_graphs=False")
    parser.add_argument("--passes", type=int, default=3, help="timed passes over the dataset")
    parser.add_argument("--optimize-on", choices=["cpu", "cuda"], default="cpu", help="where optimize() runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, measures nothing")
    args = parser.parse_args()
    os.environ.update(NO_MULTICAST)
    import fuser

    if "tune" not in inspect.signature(fuser.optimize).parameters:  # older fuser: no measuring in any rank,
        os.environ["FUSER_AUTOTUNE"] = "0"  # so every process takes the same tile choices
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --quick) to check the script on the CPU")
    from benchmarks import real_models
    from benchmarks.gpu_models import versions

    gpus = (args.gpus or torch.cuda.device_count()) if args.device == "cuda" else 1
    procs = gpus * args.procs_per_gpu if args.device == "cuda" else args.procs
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    images, batch = (12, 3) if args.quick else (args.images, args.batch)
    threads = 1 if args.device == "cpu" else None  # each CPU process one thread: N processes, N cores
    now = datetime.datetime.now(datetime.timezone.utc)
    result: dict[str, Any] = {
        "benchmark": "multi_gpu",
        "date": now.date().isoformat(),
        "time": now.strftime("%H:%M UTC"),
        "card": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "gpus_present": torch.cuda.device_count() if args.device == "cuda" else 0,
        "versions": versions(),
        "settings": {
            "images": images,
            "batch": batch,
            "dtype": dtype,
            "procs_per_gpu": args.procs_per_gpu,
            "passes": 1 if args.quick else args.passes,
            "fuser_autotune_env": os.environ.get("FUSER_AUTOTUNE"),
        },
        "rows": [],
    }
    if args.quick:
        result["partial"] = "a --quick check of the script: tiny sizes, not a measurement"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"multi-gpu-{result['date']}{'-quick' if args.quick else ''}.json"
    for name in args.models.split(","):
        size = args.size or (64 if args.quick else real_models.MODELS[name].size)
        with tempfile.TemporaryDirectory(prefix="multi-gpu-model-") as tmp:
            saved = Path(tmp) / f"{name}.pt"
            try:
                graphs = args.device == "cuda" and not args.no_cuda_graphs
                info = save_optimized(name, size, dtype, saved, graphs, args.optimize_on)
            except Exception as e:
                result["rows"].append({"model": name, "device": args.device, "error": f"{type(e).__name__}: {e}"[:500]})
                continue  # fmt: skip
            baseline = None
            for n in dict.fromkeys([1, procs]):
                row: dict[str, Any] = {"model": name, "device": args.device, "gpus": n, "size": size} | info
                try:
                    run = run_data_parallel(
                        saved, device=args.device, procs=n, gpus=min(gpus, n), batches=images // batch,
                        batch=batch, size=size, dtype=dtype, threads=threads, passes=1 if args.quick else args.passes,
                    )  # fmt: skip
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    result["rows"].append(row)
                    continue
                baseline = baseline or run
                row |= {k: run[k] for k in ("images_per_s", "elapsed_s", "backend", "on_device", "rank_devices")}
                row["scaling"] = run["images_per_s"] / baseline["images_per_s"]
                row["outputs_equal"] = None if run is baseline else run["digests"] == baseline["digests"]
                result["rows"].append(row)
                print(
                    f"{name} {n} process(es) on {args.device}: {row['images_per_s']:.1f} images/s, "
                    f"scaling {row['scaling']:.2f}x, outputs equal: {row['outputs_equal']}",
                    flush=True,
                )
        path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"wrote {path}")


def table(result: dict) -> str:
    lines = [
        "| model | device | processes | images/s | scaling | outputs equal | backend |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['device']} | {r.get('gpus', '-')} | error: {r['error']} | | | |")
            continue
        equal = "(reference)" if r["outputs_equal"] is None else str(r["outputs_equal"])
        lines.append(
            f"| {r['model']} | {r['device']} | {r['gpus']} | {r['images_per_s']:.1f} | {r['scaling']:.2f}x | "
            f"{equal} | {r['backend']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
