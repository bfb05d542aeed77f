"""Do the kernels compiled ahead land where the JIT looks them up? Per model, in a fresh process with empty
Triton, fuser and Inductor caches, one cold ``fuser.optimize()`` with compile-ahead on, and what it did:

    python -m benchmarks.compile_ahead_check --out DIR                       # the GPU run, ~2-3 min
    python -m benchmarks.compile_ahead_check --simulate --models fuser.resnet26 --size 64   # CPU dry run

Each row: the variants the collecting forward listed and handed to the workers, how many the workers
compiled, how many of them had to adopt the listing process's source key of their kernel (Triton 3.6,
``fuser.kernels.precompile.adopt_function_key``) or were still filed under another key than the listing
process computed; then every compile this process's JIT did during optimize() (Triton's compilation
listener: a cache hit is a load of what a worker compiled, a miss a compile here), the cold optimize()
seconds, and for each miss the fields of Triton's cache key (``precompile.cache_key_parts``) in which it
differs from the nearest variant the workers compiled -- or that no variant of its kernel was listed;
on a GPU also ``phases_s``, the seconds of optimize()'s steps (:data:`PHASES`: the model copy, the graph
passes, compiling ahead with the collecting forward and the wait for the workers, the CUDA graph's
warm-up and recording), so the seconds outside the workers are named.
A short table comes last; the rows go to ``compile-ahead-check-<date>.json`` under ``--out``.

``--simulate`` (no GPU): the same steps planned as on an sm_90 GPU, with an interpreter-fused model and
the JIT's lookups warming up instead of launching (a miss compiles here, on the CPU: use a small model).
``--baseline`` also runs each model with compiling ahead off, for the serial figure; ``--starts fork,spawn``
runs each model once per way of starting the workers (``FUSER_COMPILE_START``), for the same-run comparison.
``--profile`` runs the cold optimize() under cProfile and keeps its largest entries (cumulative and own time)
in the row: where the seconds outside the workers go. cProfile slows Python-heavy parts, so the row's seconds
are not the plain figure.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import hashlib
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

MODELS = "fuser.yolov8n,fuser.resnet50,fuser.efficientnet_b0"
SHOWN = 300  # characters of a differing key field kept in the JSON


class Recorder:
    """What optimize() did about compiling, seen from this process: the variants handed to the workers,
    each worker result, and every compile of this process's JIT with its cache key's parts."""

    def __init__(self) -> None:
        self.submitted: list[Any] = []
        self.results: list[tuple[Any, Any]] = []
        self.compiles: list[dict[str, Any]] = []
        self._parts: dict[str, dict[str, str]] = {}
        self.launcher_s, self.launcher_calls = 0.0, 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[Recorder]:
        from triton import knobs
        from triton.compiler import compiler as triton_compiler

        from fuser.kernels import precompile

        submit, worker_compile = precompile.Workers.submit, precompile._Worker.compile
        real_key, previous = triton_compiler.get_cache_key, knobs.compilation.listener

        def record_submit(workers: Any, variant: Any, progress: Any = None) -> None:
            self.submitted.append(variant)
            submit(workers, variant, progress)

        def record_result(worker: Any, variant: Any) -> Any:
            result = worker_compile(worker, variant)
            self.results.append((variant, result))
            return result

        def key(src: Any, backend: Any, options: Any, env_vars: dict[str, str]) -> str:
            # The JIT asks for keys far more often than it compiles: take each key's parts apart once.
            full = real_key(src, backend, options, env_vars)
            digest = hashlib.sha256(full.encode("utf-8")).hexdigest()
            if digest not in self._parts:
                with contextlib.suppress(Exception):
                    self._parts[digest] = precompile.cache_key_parts(src, backend, options, env_vars)
            return full

        def listener(*, src: Any, metadata: dict[str, Any], cache_hit: bool, **kwargs: Any) -> None:
            digest = str(metadata.get("hash", ""))
            self.compiles.append({"kernel": src.name, "hit": bool(cache_hit), "hash": digest})
            if previous is not None:
                previous(src=src, metadata=metadata, cache_hit=cache_hit, **kwargs)

        precompile.Workers.submit, precompile._Worker.compile = record_submit, record_result  # type: ignore[method-assign]
        triton_compiler.get_cache_key, knobs.compilation.listener = key, listener
        try:
            with self._timing_launchers():
                yield self
        finally:
            precompile.Workers.submit, precompile._Worker.compile = submit, worker_compile  # type: ignore[method-assign]
            triton_compiler.get_cache_key, knobs.compilation.listener = real_key, previous

    @contextlib.contextmanager
    def _timing_launchers(self) -> Iterator[None]:
        """Seconds this process spends getting C launchers (Triton up to 3.8 builds one per kernel
        signature, with the C compiler, unless a worker left it in the cache: precompile.build_launcher)."""
        try:
            from triton.backends.nvidia import driver as nvidia_driver
        except ImportError:
            yield
            return
        real = getattr(nvidia_driver, "compile_module_from_src", None)
        if real is None or not hasattr(nvidia_driver, "make_launcher"):
            yield
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                if kwargs.get("name") == "__triton_launcher":
                    self.launcher_s += time.perf_counter() - start
                    self.launcher_calls += 1

        nvidia_driver.compile_module_from_src = timed
        try:
            yield
        finally:
            nvidia_driver.compile_module_from_src = real

    def misses(self) -> list[dict[str, Any]]:
        """Each JIT compile that missed the cache, with what tells it from the variants compiled ahead."""
        from fuser.kernels import precompile

        ahead = [(variant, result, precompile.key_parts(variant)) for variant, result in self.results]
        out = []
        for event in (e for e in self.compiles if not e["hit"]):
            parts = self._parts.get(event["hash"])
            row: dict[str, Any] = {"kernel": event["kernel"], "hash": event["hash"]}
            same_kernel = [a for a in ahead if a[0].name == event["kernel"]]
            if parts is None or not same_kernel:
                row["why"] = "no variant of this kernel was compiled ahead" if parts is not None else "key not seen"
                out.append(row)
                continue
            diffs = [(name_diffs(parts, theirs), variant, result) for variant, result, theirs in same_kernel]
            fields, variant, result = min(diffs, key=lambda d: len(d[0]))
            row["nearest"] = variant.describe()
            row["worker_filed_as_listed"] = result.cache_hash == variant.cache_hash
            row["worker_adopted_key"] = result.adopted
            if not fields:
                differs = ", ".join(result.differs(variant)) or "?"
                row["why"] = f"listed with the JIT's key, but the worker's key differs in {differs}"
                row["worker_filed_under"] = result.cache_hash
            else:
                row["why"] = "differs in " + ", ".join(fields)
                row["fields"] = {f: {"jit": parts.get(f, "")[:SHOWN], "ahead": theirs_of(f, variant)} for f in fields}
            out.append(row)
        return out


def name_diffs(jit: dict[str, str], ahead: dict[str, str]) -> list[str]:
    return [name for name in sorted(set(jit) | set(ahead)) if name != "hash" and jit.get(name) != ahead.get(name)]


def theirs_of(field: str, variant: Any) -> str:
    from fuser.kernels import precompile

    return precompile.key_parts(variant).get(field, "")[:SHOWN]


def _prepared(name: str, batch: int, size: int | None, device: str) -> tuple[Any, torch.Tensor]:
    from benchmarks import real_models

    model, x = real_models.build(name, batch, size)
    model = model.to(device=device, memory_format=torch.channels_last)
    return model, x.to(device).contiguous(memory_format=torch.channels_last)


@contextlib.contextmanager
def _warming_up() -> Iterator[None]:
    """``kernel[grid](...)`` compiles (or loads) the launch's variant without running it: what a
    launch does first, on a machine without the GPU."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: self.run(*a, grid=grid, warmup=True, **k)  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.__getitem__ = original  # type: ignore[method-assign]


def _optimize_cuda(name: str, batch: int, size: int | None) -> Callable[[], Any]:
    import fuser

    model, x = _prepared(name, batch, size, "cuda")
    torch.cuda.synchronize()

    def run() -> Any:
        fused = fuser.optimize(model, (x,), precision="tf32", backend="auto", cuda_graphs=True)
        torch.cuda.synchronize()
        return fused

    return run


def _optimize_simulated(name: str, batch: int, size: int | None, arch: str) -> Callable[[], Any]:
    """optimize()'s compile steps as on ``arch``: compile ahead from a collecting forward, then the
    JIT's lookups of every launch (warming up)."""
    import fuser
    from fuser.kernels import launch, precompile

    model, x = _prepared(name, batch, size, "cpu")
    fused = fuser.optimize(model, (x,), precision="tf32", backend="interpret", cuda_graphs=False)

    def run() -> Any:
        ahead = precompile.Ahead(True)
        try:
            with torch.no_grad(), precompile.target_only_driver(precompile.parse_arch(arch)):
                with launch.simulating(arch):
                    ahead.compile(lambda: fused(x))
                with launch.simulating(arch), _warming_up():
                    fused(x)
        finally:
            ahead.close()
        return fused

    return run


def profile_top(profile: cProfile.Profile, count: int) -> dict[str, list[list[Any]]]:
    """The ``count`` largest entries of a profile by cumulative and by own time: [function, seconds, calls]."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]

    def name(key: tuple[str, int, str]) -> str:
        file, line, function = key
        return f"{Path(file).name}:{line}:{function}" if line else function

    def top(index: int) -> list[list[Any]]:
        ranked = sorted(stats.items(), key=lambda item: item[1][index], reverse=True)[:count]
        return [[name(key), round(value[index], 3), value[1]] for key, value in ranked]

    return {"cumulative": top(3), "own": top(2)}


# The steps of a cold optimize() on CUDA, timed by wrapping them: (module, class or None, function).
PHASES = [
    ("fuser.api", None, "_working_copy"),
    ("fuser.api", None, "_run_pipeline"),
    ("fuser.kernels.precompile", "Ahead", "compile"),
    ("fuser.kernels.precompile", "Workers", "finish"),
    ("fuser.runtime.cuda_graphs", "CudaCapture", "warm_up"),
    ("fuser.runtime.cuda_graphs", "CudaCapture", "record"),
]


@contextlib.contextmanager
def phase_timers(seconds: dict[str, float]) -> Iterator[None]:
    """Add each :data:`PHASES` step's wall seconds into ``seconds`` (by ``Class.function``) while open."""
    import importlib

    undo = []
    for module_name, class_name, function_name in PHASES:
        owner: Any = importlib.import_module(module_name)
        owner = getattr(owner, class_name) if class_name else owner
        real = getattr(owner, function_name)
        label = f"{class_name + '.' if class_name else ''}{function_name}"

        def timed(*args: Any, _real: Any = real, _label: str = label, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                seconds[_label] = round(seconds.get(_label, 0.0) + time.perf_counter() - start, 3)

        setattr(owner, function_name, timed)
        undo.append((owner, function_name, real))
    try:
        yield
    finally:
        for owner, function_name, real in undo:
            setattr(owner, function_name, real)


def child(spec: str, out: Path, simulate: str | None, profile: bool = False) -> None:
    import triton

    from fuser.kernels import precompile

    name, batch, size = spec.split(":")
    size_arg = int(size) if size else None
    recorder = Recorder()
    optimize = (
        _optimize_simulated(name, int(batch), size_arg, simulate)
        if simulate
        else _optimize_cuda(name, int(batch), size_arg)
    )
    profiler = cProfile.Profile() if profile else None
    phases: dict[str, float] = {}
    with recorder.watching(), phase_timers(phases) if not simulate else contextlib.nullcontext():
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        optimize()
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - start
    report = precompile.last_report()
    hits = sum(e["hit"] for e in recorder.compiles)
    row = {
        "model": name,
        "batch": int(batch),
        "workers_env": os.environ.get(precompile.WORKERS_ENV),
        "workers_start": report.start if report is not None else None,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "simulated": simulate,
        "optimize_s_cold": round(seconds, 2),
        "phases_s": phases,
        "variants_listed": len(recorder.submitted),
        "compiled_by_workers": len(recorder.results),
        "adopted_function_keys": sum(r.adopted for _, r in recorder.results),
        "filed_as_listed": sum(r.cache_hash == v.cache_hash for v, r in recorder.results),
        "compile_ahead": dataclasses.asdict(report) if report is not None else None,
        "jit_compiles": len(recorder.compiles),
        "jit_hits": hits,
        "jit_misses": len(recorder.compiles) - hits,
        "launchers_here": recorder.launcher_calls,
        "launcher_s_here": round(recorder.launcher_s, 2),
        "misses": recorder.misses(),
        "listed": [v.describe() for v in recorder.submitted],
    }
    if profiler is not None:
        row["profile"] = profile_top(profiler, 45)
    out.write_text(json.dumps(row, indent=1) + "\n")


def _env(root: Path, workers: str, start: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FUSER_AUTOTUNE="0")
    env["FUSER_COMPILE_WORKERS"] = workers
    if start is not None:
        env["FUSER_COMPILE_START"] = start
    for var in ("TRITON_CACHE_DIR", "FUSER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        folder = root / var.lower()
        folder.mkdir(parents=True)
        env[var] = str(folder)
    return env


def run_row(name: str, args: argparse.Namespace, workers: str, start: str | None = None) -> dict[str, Any]:
    """One model in a fresh process (under /tmp, empty caches); a crash or timeout is a row with an error."""
    root = Path(tempfile.mkdtemp(prefix="compile-ahead-check-", dir="/tmp"))
    out = root / "row.json"
    spec = f"{name}:{args.batch}:{args.size or ''}"
    command = [sys.executable, "-m", "benchmarks.compile_ahead_check", "--child", spec, "--child-out", str(out)]
    if args.simulate:
        command += ["--simulate-arch", args.arch]
    if args.profile:
        command.append("--child-profile")
    cwd = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run(command, env=_env(root, workers, start), cwd=cwd,
                              timeout=args.timeout, check=False)  # fmt: skip
        error = None if done.returncode == 0 else f"row process exited with code {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"row process ran past {args.timeout} s"
    row = json.loads(out.read_text()) if out.exists() else {"model": name, "batch": args.batch}
    if error is not None:
        row["error"] = error
    shutil.rmtree(root, ignore_errors=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | workers | start | listed | by workers | adopted key | filed as listed | JIT hits | JIT misses "
        "| workers ready s | optimize s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        ready = (r.get("compile_ahead") or {}).get("workers_ready_s")
        cells = [r.get("model"), r.get("workers_env"), r.get("workers_start"), r.get("variants_listed"),
                 r.get("compiled_by_workers"), r.get("adopted_function_keys"), r.get("filed_as_listed"),
                 r.get("jit_hits"), r.get("jit_misses"), ready, r.get("optimize_s_cold", r.get("error"))]  # fmt: skip
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="benchmarks.real_models names, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, help="input size (default: each model's own)")
    parser.add_argument("--workers", default="auto", help="FUSER_COMPILE_WORKERS of the rows (default auto)")
    parser.add_argument("--baseline", action="store_true", help="also each model with compiling ahead off")
    parser.add_argument("--starts", help="FUSER_COMPILE_START of the rows, comma-separated: a row per model and each")
    parser.add_argument("--simulate", action="store_true", help="no GPU: plan as on --arch (a CPU dry run)")
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per row")
    parser.add_argument("--out", type=Path, help="write the JSON into this folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="run the cold optimize() under cProfile")
    parser.add_argument("--simulate-arch", help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_out, args.simulate_arch, args.child_profile)
        return
    if not args.simulate and not torch.cuda.is_available():
        raise SystemExit("this measures optimize() on a CUDA GPU; without one, pass --simulate (a dry run)")
    rows = []
    starts = args.starts.split(",") if args.starts else [None]
    for name in args.models.split(","):
        runs = [(args.workers, start) for start in starts] + ([("0", None)] if args.baseline else [])
        for workers, start in runs:
            row = run_row(name, args, workers, start)
            rows.append(row)
            for miss in row.get("misses", []):
                print(f"  miss {miss['kernel']}: {miss['why']}", flush=True)
            keys = ("model", "workers_env", "workers_start", "jit_hits", "jit_misses", "optimize_s_cold")
            short = {k: row.get(k) for k in keys}
            print(json.dumps({**short, "error": row.get("error")}), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.simulate else "CPU"
        payload = {"benchmark": "compile_ahead_check", "date": now.isoformat(timespec="minutes"), "device": device,
                   "cores": len(os.sched_getaffinity(0)), "rows": rows}  # fmt: skip
        path = args.out / f"compile-ahead-check-{now.date().isoformat()}.json"
        path.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {path}")
    print(table(rows))


if __name__ == "__main__":
    main()
