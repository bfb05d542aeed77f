"""Regenerate the results: in full in benchmarks/README.md, as a short summary in the README.

    python -m benchmarks.readme_results     # rewrites both files between their results markers

Each table is made by the benchmark that wrote the JSON (its ``table`` function), so a figure in either
file is always one that a committed script measured and a committed JSON holds. Per benchmark the
newest complete run is shown with the other complete runs of its date and format (a run's JSON may say
"superseded": kept as evidence, listed only; or "partial": a follow-up, shown after), earlier runs are
listed as links.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks import cpu_models, gpu_models, layers, multi_gpu, zoo_cpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DETAILS = ROOT / "benchmarks" / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

SOURCES: list[tuple[str, Callable[[dict], str], str]] = [
    (
        "layers-*.json",
        layers.table,
        "Layers on the GPU (fused kernel against eager, cuDNN with BN folded, torch.compile and the roofline floor)",
    ),
    ("gpu-models-*.json", gpu_models.table, "Whole models on the GPU"),
    ("multi-gpu-*.json", multi_gpu.table, "Data-parallel inference (one process per device)"),
    ("cpu-models-*.json", cpu_models.table, "Whole models on the CPU (torch backend)"),
    ("zoo-cpu-*.json", zoo_cpu.table, "Real-library models (tests/zoo's models and checks, CPU, torch backend)"),
]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _order(path: Path) -> tuple:
    result = _load(path)
    return (result.get("date", ""), result.get("format", 1), result.get("time", ""), path.name)


def runs(pattern: str) -> tuple[list[Path], list[Path], list[Path]]:
    """(complete runs shown in full, partial follow-ups shown after, earlier runs listed as links)."""
    found = sorted((p for p in RESULTS.glob(pattern) if not p.stem.endswith("-quick")), key=_order)
    candidates = [p for p in found if "superseded" not in _load(p) and "partial" not in _load(p)]
    if not candidates:
        return [], [], found
    newest = _load(candidates[-1])
    same = [p for p in found if _order(p)[:2] == _order(candidates[-1])[:2] and "superseded" not in _load(p)]
    if pattern.startswith(("layers", "cpu-models", "zoo-cpu")):  # one full table: the newest
        complete = [candidates[-1]]
    else:
        complete = [p for p in same if "partial" not in _load(p)]
    partial = [p for p in same if "partial" in _load(p) and _load(p).get("date") == newest.get("date")]
    earlier = [p for p in found if p not in complete and p not in partial]
    return complete, partial, earlier


def _link(path: Path, start: Path) -> str:
    return f"[`{path.name}`]({path.relative_to(start)})"


def _block(path: Path, make_table: Callable[[dict], str], start: Path) -> str:
    result = _load(path)
    body = "\n".join(
        "####" + line.lstrip("#") if line.startswith("#") else line for line in make_table(result).splitlines()
    )
    where = result.get("card") or result.get("gpu") or result.get("machine", {}).get("cpu", "")
    versions = result.get("versions") or {k: result[k] for k in ("torch", "triton", "cuda") if k in result}
    versions = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    note = f"\n\n{result['partial']}" if "partial" in result else ""
    if result.get("benchmark") == "cpu_models" and not all("speedup_pairwise" in r for r in result["rows"]):
        note += (
            "\n\nNot a speed figure: eager and fuser were timed one after the other, not alternately, on a "
            "machine shared with other jobs. On the CPU the fused ops run their torch reference, so expect "
            "break-even at best; `python -m benchmarks.cpu_models` measures it interleaved."
        )
    plot = path.with_suffix(".png")
    picture = f"\n\n![{path.stem}]({plot.relative_to(start)})" if plot.exists() else ""
    return (
        f"{where}; {versions}; measured {result.get('date', '?')}; from {_link(path, start)}.{note}\n\n{body}{picture}"
    )


def details() -> str:
    """The full results section of benchmarks/README.md."""
    start = DETAILS.parent
    parts = []
    for pattern, make_table, title in SOURCES:
        complete, partial, earlier = runs(pattern)
        if not complete:
            parts.append(f"### {title}\n\nNot measured yet (no `benchmarks/results/{pattern}`).")
            continue
        blocks = [_block(p, make_table, start) for p in complete + partial]
        if earlier:
            blocks.append("Earlier runs: " + ", ".join(_link(p, start) for p in reversed(earlier)) + ".")
        parts.append(f"### {title}\n\n" + "\n\n".join(blocks))
    return "\n\n".join(parts)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def _ratios(rows: list[dict], base: str, new: str = "fuser+cuda_graphs") -> list[float]:
    return [r["ms"][base] / r["ms"][new] for r in rows if {base, new} <= r["ms"].keys()]


def _gpu_models_line(result: dict) -> str:
    rows = [r for r in result["rows"] if r.get("ms")]
    parts = []
    for base, label in (
        ("eager+cuda_graphs", "eager with CUDA graphs"),
        ("torch.compile reduce-overhead", "torch.compile reduce-overhead"),
    ):
        pairs = _ratios(rows, base)
        if pairs:
            parts.append(f"{_span(pairs)} against {label}")
    return f"fuser with CUDA graphs: {', '.join(parts)} ({len(rows)} model rows)" if parts else "no timings"


def _layers_line(result: dict) -> str:
    conv = [r["speedup_vs_cudnn_folded_act"] for r in result["rows"] if "speedup_vs_cudnn_folded_act" in r]
    return f"fused conv -> BN -> SiLU against cuDNN with BN folded + act: {_span(conv)} ({len(conv)} layers)"


def _cpu_models_line(result: dict) -> str:
    threads = result.get("machine", {}).get("threads", "?")
    if not all("speedup_pairwise" in r for r in result["rows"]):
        # Eager and fuser timed one after the other on a shared machine: load moved the ratios both ways.
        return (
            f"not interleaved ({threads} thread(s)): no speed figure; on the CPU expect break-even at best "
            "(`python -m benchmarks.cpu_models` measures it)"
        )
    speedups = [r["speedup_pairwise"] for r in result["rows"]]
    return f"fuser (torch backend) against eager, interleaved: {_span(speedups)}, {threads} thread(s)"


def _zoo_line(result: dict) -> str:
    rows = [r for r in result["rows"] if "error" not in r]
    before = sum(r["bn_ops_before"] for r in rows)
    folded = before - sum(r["bn_ops_after"] for r in rows)
    passed = sum(not any(r["failures"].values()) for r in rows)
    failed = len(result["rows"]) - passed
    return (
        f"{len(result['rows'])} models: every check passed on {passed}"
        + (f", {failed} failed" if failed else "")
        + f"; {folded} of {before} BatchNorms folded ({folded / before:.1%}), each other one named with its reason"
    )


def _line(pattern: str, result: dict) -> str:
    if pattern.startswith("gpu-models"):
        return _gpu_models_line(result)
    if pattern.startswith("layers"):
        return _layers_line(result)
    if pattern.startswith("cpu-models"):
        return _cpu_models_line(result)
    if pattern.startswith("zoo-cpu"):
        return _zoo_line(result)
    rows = [r for r in result["rows"] if "scaling" in r and r.get("gpus", 1) > 1]
    equal = all(r.get("outputs_equal") for r in rows)
    return f"scaling {_span([r['scaling'] for r in rows])}, outputs identical: {equal}" if rows else "no runs"


def _row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("model", "source", "layer", "batch", "dtype", "precision", "gpus"))


def newest_rows(complete: list[Path]) -> tuple[list[dict], dict[Path, int]]:
    """Each row (one model, batch and dtype; one layer) as the newest of ``complete`` measured it, and how many rows
    each run gave: a headline made from every run of a day would mix trees, one row's old time beside another's
    new one."""
    rows: dict[tuple, dict] = {}
    sources: dict[Path, int] = {}
    for path in reversed(complete):
        for row in _load(path)["rows"]:
            if _row_key(row) not in rows:
                rows[_row_key(row)] = row
                sources[path] = sources.get(path, 0) + 1
    return list(rows.values()), sources


def summary() -> str:
    """The README's results section: one line per benchmark, and where the tables are."""
    lines = [
        "Full tables and plots, and how each figure was measured: [benchmarks/README.md](benchmarks/README.md).",
        "",
        "| benchmark | newest run | headline |",
        "|---|---|---|",
    ]
    for pattern, _, title in SOURCES:
        complete, _, _ = runs(pattern)
        if not complete:
            lines.append(f"| {title} | not measured yet | |")
            continue
        rows, sources = newest_rows(complete)
        result = _load(complete[-1]) | {"rows": rows}
        where = result.get("card") or result.get("gpu") or result.get("machine", {}).get("cpu", "")
        try:
            headline = _line(pattern, result)
        except (KeyError, TypeError, ZeroDivisionError, ValueError) as e:
            headline = f"(no summary: {type(e).__name__})"
        if len(sources) > 1:
            counts = [f"{n} from `{path.name}`" for path, n in sources.items()]
            headline += f"; rows: {', '.join(counts)}"
        runs_cell = ", ".join(_link(path, ROOT) for path in sources)
        lines.append(f"| {title} | {runs_cell}, {where}, {result.get('date', '?')} | {headline} |")
    return "\n".join(lines)


def rewrite(path: Path, section: str) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{path} has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{section}\n{END}{tail}")


def main() -> None:
    rewrite(DETAILS, details())
    rewrite(ROOT / "README.md", summary())
    print("benchmarks/README.md and README.md results sections rewritten")


if __name__ == "__main__":
    main()
