"""The zoo on the CPU: every model of tests/zoo built by its own library, optimized, checked, and tabled.

    python -m benchmarks.zoo_cpu                       # writes benchmarks/results/zoo-cpu-<date>.json
    python -m benchmarks.zoo_cpu --models gpt2,yolov8n --out /tmp/check

The models, their builders and the checks are the test suite's (tests/zoo/zoo_models.py and zoo_checks.py),
imported, not copied, so the README's table says what the tests assert: per model the BatchNorms folded
and those still run (with the report's reason for each), the chains fused, the error against float64, the
original unchanged, the save/load round trip, no dead weights, and how long optimize() took (on a shared
machine that last figure is only an order of magnitude). The torch backend with ieee precision, one
thread, fuser in strict mode as in the tests. The JSON is rewritten after every model, so an interrupted
run keeps what it measured (marked partial).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import traceback
from pathlib import Path

import torch

import fuser
from benchmarks.cpu_models import commit, cpu_name

ROOT = Path(__file__).resolve().parents[1]


def _versions() -> dict[str, str | None]:
    """torch, fuser and the zoo's libraries (None: it does not import)."""
    found: dict[str, str | None] = {"torch": torch.__version__, "fuser": fuser.__version__, "fuser_commit": commit()}
    for library in ("torchvision", "timm", "ultralytics", "transformers"):
        try:
            found[library] = __import__(library).__version__
        except Exception:  # a library that does not import is a row error below, not a crash here
            found[library] = None
    return found


def run(only: list[str] | None, path: Path) -> dict:
    """Evaluate the zoo's models (or those named in ``only``), rewriting ``path`` after each."""
    os.environ.setdefault("FUSER_STRICT", "1")
    sys.path[:0] = [str(ROOT / "tests" / "zoo"), str(ROOT / "tests")]
    import zoo_checks

    zoo_checks.prepare()
    from zoo_models import ZOO

    chosen = [z for z in ZOO if not only or z.name in only]
    result = {
        "benchmark": "zoo_cpu",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_name(), "threads": 1, "python": platform.python_version()},
        "versions": _versions(),
        "method": "tests/zoo's models and checks (zoo_checks.evaluate): torch backend, ieee, one thread",
        "partial": f"{len(chosen)} models to run",
        "rows": [],
    }
    for i, zoo in enumerate(chosen):
        print(f"[zoo {i + 1}/{len(chosen)}] {zoo.name}", flush=True)
        try:
            row = zoo_checks.evaluate(zoo)
        except Exception as error:
            row = {"model": zoo.name, "library": zoo.source, "task": zoo.task}
            row |= {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
        result["rows"].append(row)
        failed = [c for c, f in row.get("failures", {}).items() if f] or row.get("error", "")
        print(f"  bn {row.get('bn_ops_after')} of {row.get('bn_ops_before')} still run, failed: {failed}", flush=True)
        if len(result["rows"]) < len(chosen):
            result["partial"] = f"{len(result['rows'])} of {len(chosen)} models run"
        elif only:
            result["partial"] = f"only the models asked for: {', '.join(only)}"
        else:
            del result["partial"]
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _kind(text: str) -> str:
    """A reason or a module path with its numbers and parenthesized paths left out: one line per kind."""
    text = re.sub(r"\s*\([^)]*\)", "", text)
    return re.sub(r"\d+", "*", re.sub(r"_\d+`", "`", text))


def _unfolded(rows: list[dict]) -> list[str]:
    """Per model, the BatchNorms that stay, grouped by reason (the JSON names each one)."""
    lines = []
    for r in rows:
        groups: dict[str, list[str]] = {}
        for name, reason in r.get("bn_unfolded", {}).items():
            groups.setdefault(_kind(reason or "not in the report"), []).append(name)
        for reason, names in groups.items():
            where = ", ".join(dict.fromkeys(_kind(n) for n in names))
            lines.append(f"- {r['model']}: {len(names)} x {reason} (`{where}`)")
    return lines


def table(result: dict) -> str:
    """The markdown of one run: the models' table, then the BatchNorms that stay, by model, with the reason."""
    rows = [r for r in result["rows"] if "error" not in r]
    before = sum(r["bn_ops_before"] for r in rows)
    after = sum(r["bn_ops_after"] for r in rows)
    share = f"{(before - after) / before:.1%}" if before else "-"
    passed = sum(not any(r["failures"].values()) for r in rows)
    lines = [
        f"{len(rows)} models: all checks passed on {passed}; {before - after} of {before} BatchNorm calls folded "
        f"({share}). Error: relative to a float64 run of the original (the tolerance is 1e-5, or twice the "
        "original's own float32 error where that is larger: a detector's boxes after NMS, or a deep random net). "
        "Dead weights: state elements of the optimized module / of the original.",
        "",
        "| model | library | task | chains fused | BNs still run / before | error vs float64 | original unchanged | "
        "save/load | state elements after / before | optimize() s | failed checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["failures"]
        failed = ", ".join(c for c, why in f.items() if why) or "-"
        ok = {c: "yes" if f[c] is None else "**no**" for c in ("untouched", "save_load")}
        lines.append(
            f"| {r['model']} | {r['library']} | {r['task']} | {r['chains_fused']} | "
            f"{r['bn_ops_after']} / {r['bn_ops_before']} | {r['rel_error']:.1e} | {ok['untouched']} | "
            f"{ok['save_load']} | {r['elements_after']} / {r['elements_before']} | {r['optimize_s']:.1f} | {failed} |"
        )
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['library']} | {r['task']} | error: {r['error'][:80]} |" + " |" * 7)
    unfolded = _unfolded(rows)
    if unfolded:
        lines += ["", "BatchNorms that stay, with the report's reason:", "", *unfolded]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--models", help="comma-separated subset of the zoo's model names")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"zoo-cpu-{datetime.date.today().isoformat()}.json"
    result = run(args.models.split(",") if args.models else None, path)
    print(table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
