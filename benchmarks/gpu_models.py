"""Whole-model benchmark: fuser against eager PyTorch and torch.compile on real models, in one run.

    python -m benchmarks.gpu_models --out DIR                     # the GPU run (about 8 minutes: --budget-s)
    python -m benchmarks.gpu_models --out DIR --device cpu --quick   # every code path on the CPU, tiny sizes
    python -m benchmarks.gpu_models --table RESULTS.json
    python -m benchmarks.gpu_models --plot RESULTS.json PNG

Models (benchmarks/real_models.py): ultralytics YOLOv8n from its yaml, torchvision ResNet-50,
EfficientNet-B0 and MobileNetV3-Large, timm and fuser.models ones; random weights, BN statistics
randomized, channels_last; batch 1 in float32 (precision tf32, TF32 allowed for cuDNN/cuBLAS too) and
batch 32 in float16. Variants, each a model as the user would call it:

- "eager"; "eager+cuda_graphs" (the eager model recorded once and replayed, fuser.runtime.cuda_graphs.GraphReplay)
- "torch.compile reduce-overhead" (freezing on: cuDNN convs, Inductor's kernels, CUDA graphs)
- "fuser" and "fuser+cuda_graphs": ``fuser.optimize(model, (x,), cuda_graphs=False / True)``
- "fuser->torch.compile reduce-overhead": ``torch.compile(fuser.optimize(model, (x,), cuda_graphs=False),
  mode="reduce-overhead")``

optimize() gets explicit arguments (precision, backend "auto", cuda_graphs, and ``tune`` where that
parameter exists: ``--tune``), so a change of fuser's defaults does not change what is measured.

Per row: ``ms`` (CUDA events over ``--calls`` back-to-back calls, median of ``--repeats``, the variants
interleaved so drift on the shared host hits all alike), ``rel_error`` (||out - ref|| / ||ref|| against
a float64 run of the same weights), ``profile`` (torch.profiler of one forward: kernels, conv/matmul GPU
ms and the rest), ``optimize_s_cold`` (the first optimize() in a process whose Triton, fuser tile and
Inductor caches are fresh empty folders) and ``compile_ahead`` (what its parallel compile did),
``compile_s`` (the first two calls of each torch.compile variant, with the same empty caches),
``first_calls_s`` (every variant's first two calls: where a lazy optimize() compiles), ``errors`` (a
variant that failed: its error, the others go on).

Each row runs in its own child process (fresh caches, so every row's figures are cold; a crash or a
CUDA error in one model cannot take the run down; ``--row-timeout-s`` bounds it). Rows start in the order
of ``ROWS`` until ``--budget-s`` is spent; the JSON is written after every row. Costs per row on an H200:
the two torch.compile variants 15-25 s each, optimize() cold 2-10 s untuned (up to a minute or more
measuring tile choices), the rest about 10-20 s: about 60-90 s a row, so about 5 rows in 8 minutes
(``--variants`` without the torch.compile ones: about twice as many).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

VARIANTS = (
    "eager",
    "eager+cuda_graphs",
    "torch.compile reduce-overhead",
    "fuser",
    "fuser+cuda_graphs",
    "fuser->torch.compile reduce-overhead",
)
COMPILED = tuple(v for v in VARIANTS if "torch.compile" in v)
# Short names for the command line (no spaces: they pass through a shell variable) and the table.
SHORT = dict(
    zip(VARIANTS, ("eager", "eager+graphs", "compile", "fuser", "fuser+graphs", "fuser->compile"), strict=True)
)

# (model, batch, dtype) in the order they run: a run cut short by --budget-s keeps the first ones.
ROWS = [
    ("yolov8n", 1, "float32"),
    ("resnet50", 1, "float32"),
    ("efficientnet_b0", 1, "float32"),
    ("mobilenet_v3_large", 1, "float32"),
    ("yolov8n", 32, "float16"),
    ("resnet50", 32, "float16"),
    ("efficientnet_b0", 32, "float16"),
    ("mobilenet_v3_large", 32, "float16"),
    ("fuser.yolov8n", 1, "float32"),
    ("timm.efficientnet_b0", 1, "float32"),
]
FORMAT = 2  # format 1 (before real models): rows with "fuser measured", no "source"; table() reads both


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| over every floating-point tensor of the outputs, in float64."""
    a = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    b = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ValueError(f"outputs differ in structure from the float64 run: {len(a)} tensors vs {len(b)}")
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b, strict=True))
    den = sum((y.double() ** 2).sum() for y in b)
    return float((num / den).sqrt())


def optimize_kwargs(precision: str, cuda_graphs: bool, tune: str) -> dict[str, Any]:
    """Explicit arguments for fuser.optimize, for the signature it has (``tune`` is newer than the rest)."""
    kwargs: dict[str, Any] = {"precision": precision, "backend": "auto", "cuda_graphs": cuda_graphs}
    if tune != "default" and "tune" in inspect.signature(__import__("fuser").optimize).parameters:
        kwargs["tune"] = tune == "on"
    return kwargs


def compile_ahead_report() -> dict[str, Any] | None:
    """What the last optimize() compiled ahead (variants, workers, seconds), where fuser does that."""
    try:
        from fuser.kernels import precompile
    except ImportError:
        return None
    report = precompile.last_report()
    return None if report is None else dataclasses.asdict(report)


class Row:
    """One (model, batch, dtype) measured in this process; ``save`` after each step keeps partial results."""

    def __init__(self, settings: dict[str, Any], name: str, batch: int, dtype: str, path: Path | None) -> None:
        from benchmarks import real_models

        self.settings, self.path = settings, path
        self.device = torch.device(settings["device"])
        spec = real_models.MODELS[name]
        self.size = settings.get("size") or spec.size
        self.data: dict[str, Any] = {
            "model": name,
            "source": spec.source,
            "batch": batch,
            "size": self.size,
            "dtype": dtype,
            "precision": "tf32" if dtype == "float32" else "fp16",
            "ms": {},
            "rel_error": {},
            "kernels": {},
            "profile": {},
            "compile_s": {},
            "errors": {},
        }
        self.model, self.x = real_models.build(name, batch, self.size)
        self.fns: dict[str, Any] = {}
        self._plain: Any = None

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1) + "\n")

    def guarded(self, label: str, step) -> Any:
        try:
            return step()
        except Exception as e:
            self.data["errors"][label] = _error(e)
            print(f"  {label}: {_error(e)}", flush=True)
            traceback.print_exc()
            return None
        finally:
            self.save()

    def reference(self) -> Any:
        model = copy.deepcopy(self.model).to(self.device, torch.float64)
        with torch.no_grad():
            return model(self.x.to(self.device, torch.float64))

    def prepare(self) -> None:
        dtype = getattr(torch, self.data["dtype"])
        self.model = self.model.to(device=self.device, dtype=dtype, memory_format=torch.channels_last)
        self.x = self.x.to(self.device, dtype).contiguous(memory_format=torch.channels_last)

    def first_calls(self, label: str, fn) -> Any:
        """Two calls (a compiled variant compiles and records here, a lazy optimize() compiles its kernels);
        their time is ``first_calls_s``, and a torch.compile variant's ``compile_s``."""
        start = time.perf_counter()
        with torch.no_grad():
            fn(self.x)
            fn(self.x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.data.setdefault("first_calls_s", {})[label] = elapsed
        if label in COMPILED:
            self.data["compile_s"][label] = elapsed
        return fn

    def compiled(self, module) -> Any:
        """torch.compile(module, mode="reduce-overhead"), freezing on, dynamo's counters cleared: it compiles
        at its first calls (:meth:`first_calls`), after which :meth:`count_compiles` reads them."""
        import torch._dynamo.utils
        import torch._inductor.config

        torch._inductor.config.freezing = True
        torch._dynamo.utils.counters.clear()
        backend = self.settings["compile_backend"]
        kwargs = {"mode": "reduce-overhead"} if backend == "inductor" else {}
        return torch.compile(module, backend=backend, **kwargs)

    def count_compiles(self, label: str) -> None:
        """Dynamo's counts of what the first calls of ``label`` compiled."""
        import torch._dynamo.utils

        counters = torch._dynamo.utils.counters
        self.data.setdefault("dynamo", {})[label] = {
            "frames_compiled": counters["frames"]["ok"],
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }

    def optimized(self, cuda_graphs: bool) -> Any:
        import fuser

        kwargs = optimize_kwargs(self.data["precision"], cuda_graphs, self.settings["tune"])
        self.data["optimize_kwargs"] = {k: v for k, v in kwargs.items() if k != "cuda_graphs"}
        start = time.perf_counter()
        fused = fuser.optimize(self.model, (self.x,), **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        key = "optimize_s_warm" if "optimize_s_cold" in self.data else "optimize_s_cold"
        self.data[key] = time.perf_counter() - start
        if key == "optimize_s_cold":
            self.data["compile_ahead"] = compile_ahead_report()
        self.data["fused_chains"] = len(fused.fusion_report.fused)
        self.data["rejected_chains"] = len(fused.fusion_report.rejected)
        return fused

    def plain(self) -> Any:
        """fuser without CUDA graphs: its own variant, and what torch.compile gets in fuser->torch.compile."""
        if self._plain is None:
            self._plain = self.optimized(cuda_graphs=False)
        return self._plain

    def build_variants(self, labels: list[str]) -> None:
        from fuser.runtime.cuda_graphs import GraphReplay

        steps = {
            "eager": lambda: self.model,
            "eager+cuda_graphs": lambda: GraphReplay(self.model),
            "torch.compile reduce-overhead": lambda: self.compiled(self.model),
            # the first optimize() of the row is this one, with the caches empty: optimize_s_cold
            "fuser+cuda_graphs": lambda: self.optimized(cuda_graphs=True),
            "fuser": self.plain,
            "fuser->torch.compile reduce-overhead": lambda: self.compiled(self.plain()),
        }
        for label in [v for v in steps if v in labels]:
            fn = self.guarded(label, lambda label=label: self.first_calls(label, steps[label]()))
            if fn is not None:
                self.fns[label] = fn
                if label in COMPILED:
                    self.count_compiles(label)
            print(f"  built {label}", flush=True)

    def measure(self, reference: Any) -> None:
        """Time every variant built so far, interleaved; error and profile for those that have none yet."""
        from benchmarks.measure import profile_forward, time_ms

        s = self.settings
        with torch.no_grad():
            for label, fn in list(self.fns.items()):
                if label in self.data["rel_error"]:
                    continue
                error = self.guarded(label, lambda fn=fn: rel_error(fn(self.x), reference))
                if error is None:
                    del self.fns[label]
                else:
                    self.data["rel_error"][label] = error
            runs: dict[str, list[float]] = {label: [] for label in self.fns}
            for r in range(s["repeats"]):  # interleaved: repeat r of every variant, then repeat r + 1
                for label, fn in list(self.fns.items()):
                    warmup = s["warmup"] if r == 0 else 0
                    ms = self.guarded(
                        label, lambda fn=fn, w=warmup: time_ms(lambda: fn(self.x), self.device, s["calls"], 1, w)
                    )
                    if ms is None:
                        del self.fns[label], runs[label]
                    else:
                        runs[label].append(ms)
            for label, times in runs.items():
                self.data["ms"][label] = statistics.median(times)
            for label, fn in self.fns.items():
                if label in self.data["profile"]:
                    continue
                prof = self.guarded(label, lambda fn=fn: profile_forward(lambda: fn(self.x), self.device))
                if prof is not None:
                    self.data["profile"][label] = prof
                    self.data["kernels"][label] = prof["count"]
        eager = self.data["ms"].get("eager")
        if eager:
            self.data["speedup_vs_eager"] = {k: eager / v for k, v in self.data["ms"].items()}
        self.save()


def run_row(settings: dict[str, Any], name: str, batch: int, dtype: str, path: Path | None = None) -> dict:
    """Measure one row in this process; each step guarded (a failure is recorded and the rest goes on)."""
    if settings["device"] == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    row = Row(settings, name, batch, dtype, path)
    reference = row.guarded("float64 reference", row.reference)
    row.prepare()
    if reference is None:
        row.data["errors"]["measure"] = "no float64 reference: nothing measured"
        row.save()
        return row.data
    wanted = settings["variants"]
    # The torch.compile variants last: a row stopped while compiling keeps the other variants' figures.
    # Once they are built every variant is timed again, so all final figures come from one interleaved set.
    for phase in ([v for v in wanted if v not in COMPILED], [v for v in wanted if v in COMPILED]):
        if phase:
            row.build_variants(phase)
            row.measure(reference)
    return row.data


def _cold_env(root: Path) -> dict[str, str]:
    """The environment of a row's process: its own empty Triton, fuser and Inductor caches."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("TRITON_CACHE_DIR", "FUSER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        folder = root / var.lower()
        folder.mkdir(parents=True)
        env[var] = str(folder)
    return env


def run_child(settings: dict[str, Any], spec: tuple[str, int, str], timeout_s: float) -> dict:
    """Run one row in a fresh process with empty caches; what it saved survives its crash or timeout."""
    name, batch, dtype = spec
    root = Path(tempfile.mkdtemp(prefix="gpu-models-row-"))
    out = root / "row.json"
    command = [sys.executable, "-m", "benchmarks.gpu_models", "--child", f"{name}:{batch}:{dtype}"]
    command += ["--child-out", str(out), "--child-settings", json.dumps(settings)]
    error = None
    # Its own session: on a timeout the whole group goes, Inductor's compile workers included.
    child = subprocess.Popen(command, env=_cold_env(root), cwd=Path(__file__).parents[1], start_new_session=True)
    try:
        rc = child.wait(timeout=timeout_s)
        if rc != 0:
            error = f"row process exited with code {rc} (its traceback is in the log above)"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        error = f"row process timed out after {timeout_s:.0f} s (--row-timeout-s)"
    except BaseException:  # interrupted or terminated (main turns SIGTERM into SystemExit): no orphans
        os.killpg(child.pid, signal.SIGKILL)
        raise
    row = json.loads(out.read_text()) if out.exists() else {"model": name, "batch": batch, "dtype": dtype}
    if error:
        row.setdefault("errors", {})["row"] = error
    shutil.rmtree(root, ignore_errors=True)
    return row


SOURCE_FOLDERS = ("fuser", "kernels", "models")


def source_digest(root: Path | None = None) -> str:
    """A digest of fuser's sources as they are on disk (every .py and .json under :data:`SOURCE_FOLDERS`, by
    relative path): which tree a run measured, also where the git metadata beside the files is not that
    tree's (the device machine's copy of a working tree). ``python -c "from benchmarks.gpu_models import
    source_digest; print(source_digest())"`` gives it for a checkout."""
    root = Path(__file__).resolve().parents[1] if root is None else root
    digest = hashlib.sha256()
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def versions() -> dict[str, str | bool | None]:
    found: dict[str, str | bool | None] = {"python": platform.python_version(), "torch": torch.__version__}
    found["cuda"] = torch.version.cuda
    for dist in ("triton", "torchvision", "timm", "ultralytics", "fuser"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    found["fuser_commit"], found["fuser_commit_is_source"] = git_commit()
    found["fuser_source"] = source_digest()
    return found


def git_commit(root: Path | None = None) -> tuple[str | None, bool | None]:
    """The git HEAD beside the sources, and whether the sources on disk (:data:`SOURCE_FOLDERS`) are that commit's:
    False where they differ from it, as on the device machine, whose copy of a working tree keeps the git metadata
    of an earlier commit (then :func:`source_digest` names the tree). ``(None, None)`` without git."""
    root = Path(__file__).resolve().parents[1] if root is None else root
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=root)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None, None
        changed = git("status", "--porcelain", "--", *SOURCE_FOLDERS).stdout.strip()
    except OSError:
        return None, None
    return head.stdout.strip(), not changed


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _ratio(ms: dict[str, float], base: str, new: str) -> str:
    return f"{ms[base] / ms[new]:.2f}x" if base in ms and new in ms else "-"


def _table_v1(result: dict) -> str:
    labels = list(dict.fromkeys(k for r in result["rows"] for k in r["ms"]))
    lines = [
        "| model | B, size, dtype | chains | " + " | ".join(f"{k} ms" for k in labels) + " | fuser vs eager | "
        "both with CUDA graphs |",
        "|" + "---|" * (len(labels) + 5),
    ]
    for r in result["rows"]:
        ms = r["ms"]
        cells = " | ".join(_fmt(ms.get(k)) for k in labels)
        lines.append(
            f"| {r['model']} | {r['batch']}, {r['size']}, {r['dtype']} | {r['fused_chains']} | {cells} | "
            f"{_ratio(ms, 'eager', 'fuser')} | {_ratio(ms, 'eager+cuda_graphs', 'fuser+cuda_graphs')} |"
        )
    return "\n".join(lines)


def table(result: dict) -> str:
    """Markdown: ms per variant and the ratios the targets name; then kernels, GPU split and errors."""
    if result.get("format") != FORMAT:
        return _table_v1(result)
    short = list(SHORT.values())
    lines = [
        "| model (source) | B, dtype | chains | "
        + " | ".join(f"{s} ms" for s in short)
        + " | fuser+graphs vs eager+graphs | vs compile r-o | optimize s cold | compile s |",
        "|" + "---|" * (len(short) + 7),
    ]
    details = [
        "| model | B, dtype | " + " | ".join(f"{s} kernels (conv / other GPU ms), error" for s in short) + " |",
        "|" + "---|" * (len(short) + 2),
    ]
    failures, compiles = [], []
    for r in result["rows"]:
        ms = r.get("ms", {})
        head = f"{r['model']} ({r.get('source', '?')})"
        compile_s = "/".join(f"{v:.0f}" for v in r.get("compile_s", {}).values()) or "-"
        lines.append(
            f"| {head} | {r['batch']}, {r['dtype']} | {r.get('fused_chains', '-')} | "
            + " | ".join(_fmt(ms.get(v)) for v in VARIANTS)
            + f" | {_ratio(ms, 'eager+cuda_graphs', 'fuser+cuda_graphs')}"
            f" | {_ratio(ms, 'torch.compile reduce-overhead', 'fuser+cuda_graphs')}"
            f" | {_fmt(r.get('optimize_s_cold'), '.1f')} | {compile_s} |"
        )
        cells = []
        for v in VARIANTS:
            p, err = r.get("profile", {}).get(v), r.get("rel_error", {}).get(v)
            prof = f"{p['count']} ({p['conv_ms']:.3f} / {p['other_ms']:.3f})" if p else "-"
            cells.append(f"{prof}, {_fmt(err, '.1e')}")
        details.append(f"| {r['model']} | {r['batch']}, {r['dtype']} | " + " | ".join(cells) + " |")
        failures += [f"- {r['model']} B{r['batch']} {r['dtype']}, {k}: {e}" for k, e in r.get("errors", {}).items()]
        for label, d in r.get("dynamo", {}).items():
            compiles.append(
                f"- {r['model']} B{r['batch']} {r['dtype']}, {label}: {d['frames_compiled']} frames compiled, "
                f"{d['unique_graphs']} graphs, {d['graph_breaks']} graph breaks"
            )
    text = "\n".join(lines) + "\n\nKernels per forward, their GPU time, and error against float64:\n\n"
    text += "\n".join(details)
    if compiles:
        text += "\n\nWhat torch.compile compiled (dynamo's counters over the first two calls):\n" + "\n".join(compiles)
    if result.get("left_out"):
        text += "\n\nLeft out (time budget spent): " + ", ".join(result["left_out"])
    if failures:
        text += "\n\nFailures (recorded, the run went on):\n" + "\n".join(failures)
    return text


def plot(result: dict, png: Path) -> None:
    """Speedup of each variant over eager (log scale) and, below, each variant's conv / other GPU ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in result["rows"] if r.get("ms", {}).get("eager")]
    if not rows:
        return
    present = {k for r in rows for k in r["ms"]}
    all_labels = [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))  # format 1's too
    labels = [v for v in all_labels if v != "eager"]
    palette = matplotlib.colormaps["tab10"]
    color = {v: palette(i % 10) for i, v in enumerate([*VARIANTS, *sorted(present - set(VARIANTS))])}
    profiled = any(r.get("profile") for r in rows)  # format 1 has no profiles: one panel
    fig, axes = plt.subplots(2 if profiled else 1, 1, figsize=(max(7.0, 1.8 * len(rows)), 9.0 if profiled else 4.8))
    top = axes[0] if profiled else axes
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["ms"]["eager"] / r["ms"][label] if label in r["ms"] else 0 for r in rows]
        top.bar(xs, ys, width, label=label, color=color[label])
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_yscale("log")
    top.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    top.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ticks = [f"{r['model']}\nB{r['batch']} {r['dtype']}" for r in rows]
    top.set_xticks(range(len(rows)), ticks, fontsize=7)
    top.set_ylabel("speedup over eager (x)")
    top.set_title(f"whole models on {result.get('card')} ({result.get('date')})", fontsize=9)
    top.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    if not profiled:
        _save(fig, png)
        return
    bottom = axes[1]
    width = 0.8 / len(all_labels)
    for i, label in enumerate(all_labels):
        xs = [j + (i - (len(all_labels) - 1) / 2) * width for j in range(len(rows))]
        conv = [r.get("profile", {}).get(label, {}).get("conv_ms", 0) for r in rows]
        other = [r.get("profile", {}).get(label, {}).get("other_ms", 0) for r in rows]
        bottom.bar(xs, conv, width, label=label, color=color[label])
        bottom.bar(xs, other, width, bottom=conv, color=color[label], alpha=0.4, hatch="//")
    bottom.set_xticks(range(len(rows)), ticks, fontsize=7)
    unit = rows[0].get("profile", {}).get("eager", {}).get("unit", "kernels")
    bottom.set_ylabel(f"ms in one forward ({unit}):\nconv/matmul solid, rest hatched")
    bottom.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    _save(fig, png)


def _save(fig, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 2, size 64, a few calls: checks the paths")
    parser.add_argument("--models", help="comma-separated: only these models (names in benchmarks/real_models.py)")
    parser.add_argument("--rows", nargs="+", metavar="MODEL:BATCH:DTYPE", help="these rows instead of ROWS")
    parser.add_argument("--size", type=int, help="input size for every model (default: each model's own)")
    parser.add_argument("--variants", help=f"comma-separated subset of: {', '.join(SHORT.values())}")
    parser.add_argument("--calls", type=int, default=50, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant (the median is kept)")
    tune_help = "optimize(tune=...) where fuser has it (else FUSER_AUTOTUNE); default: pass nothing"
    parser.add_argument("--tune", choices=["off", "on", "default"], default="off", help=tune_help)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (CPU checks: eager)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new row after this long")
    parser.add_argument("--row-timeout-s", type=float, default=180.0, help="a row's process is stopped after this")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results JSON and exit")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("RESULTS", "PNG"), help="write the plot and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return
    if args.child:
        name, batch, dtype = args.child.split(":")
        run_row(json.loads(args.child_settings), name, int(batch), dtype, args.child_out)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --quick) to check the script on the CPU")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the run: its row process too
    if args.tune != "default":
        import fuser

        if "tune" not in inspect.signature(fuser.optimize).parameters:  # older fuser: the environment switch
            os.environ["FUSER_AUTOTUNE"] = "1" if args.tune == "on" else "0"
    by_short = {short: v for v, short in SHORT.items()} | {v: v for v in VARIANTS}
    variants = [by_short.get(v, v) for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}: choose from {list(SHORT.values())} or {list(VARIANTS)}")
    rows = [(m, int(b), d) for m, b, d in (r.split(":") for r in args.rows)] if args.rows else list(ROWS)
    if args.models:
        rows = [r for r in rows if r[0] in args.models.split(",")]
    if args.quick:
        rows = list(dict.fromkeys((m, min(b, 2), d) for m, b, d in rows))
    from benchmarks import real_models

    missing = sorted({m for m, _, _ in rows} - set(real_models.MODELS))
    if missing:
        raise SystemExit(f"unknown models {missing}: choose from {sorted(real_models.MODELS)}")
    settings = {
        "device": args.device,
        "size": args.size or (64 if args.quick else None),
        "variants": variants,
        "calls": 3 if args.quick else args.calls,
        "repeats": 2 if args.quick else args.repeats,
        "warmup": 1 if args.quick else 3,
        "tune": args.tune,
        "compile_backend": args.compile_backend,
    }
    now = datetime.datetime.now(datetime.timezone.utc)
    result: dict[str, Any] = {
        "benchmark": "gpu_models",
        "format": FORMAT,
        "date": now.date().isoformat(),
        "time": now.strftime("%H:%M UTC"),
        "card": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or 'x86'})",
        "versions": versions(),
        "settings": settings | {"channels_last": True, "tf32_allowed": True, "cudnn_benchmark": True,
                                "fuser_autotune_env": os.environ.get("FUSER_AUTOTUNE"),
                                "timing": f"median of {settings['repeats']} x {settings['calls']} calls, "
                                          "variants interleaved"},
        "rows": [],
    }  # fmt: skip
    if args.quick:
        result["partial"] = "a --quick check of the script: tiny sizes and few calls, not a measurement"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-models-{result['date']}{'-quick' if args.quick else ''}.json"
    start = time.perf_counter()
    for i, spec in enumerate(rows):
        if time.perf_counter() - start > args.budget_s:
            result["left_out"] = [f"{m} B{b} {d}" for m, b, d in rows[i:]]
            print(f"budget of {args.budget_s:.0f} s spent: left out {', '.join(result['left_out'])}", flush=True)
            break
        print(f"[gpu_models] {spec[0]} B{spec[1]} {spec[2]} ({time.perf_counter() - start:.0f} s in)", flush=True)
        result["rows"].append(run_child(settings, spec, args.row_timeout_s))
        result["wall_s"] = time.perf_counter() - start
        path.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a run cut short keeps its rows
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    print(table(result))


if __name__ == "__main__":
    main()
