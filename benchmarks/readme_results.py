"""Regenerate the README's results section from the newest committed JSON results.

    python -m benchmarks.readme_results          # rewrites README.md between the results markers

Each table is made by the benchmark that wrote the JSON (its ``table`` function), so a figure in the
README is always one that a committed script measured and a committed JSON holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import cpu_models, gpu_models, layers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def runs(pattern: str) -> tuple[list[Path], list[Path]]:
    """(the complete runs of the newest date, the partial follow-up runs of that date). A run whose JSON
    says "superseded" (kept as evidence for a decision) is left out; one that says "partial" is shown after."""
    found = [p for p in sorted(RESULTS.glob(pattern)) if "superseded" not in _load(p)]
    complete = [p for p in found if "partial" not in _load(p)]
    if not complete:
        return [], []
    date = _load(complete[-1]).get("date")
    same_date = [p for p in found if _load(p).get("date") == date]
    if pattern.startswith("layers"):  # one full layer table: the newest
        return [complete[-1]], [p for p in same_date if "partial" in _load(p)]
    return [p for p in same_date if "partial" not in _load(p)], [p for p in same_date if "partial" in _load(p)]


def _block(path: Path, make_table) -> str:
    result = _load(path)
    body = "\n".join(
        "####" + line.lstrip("#") if line.startswith("#") else line for line in make_table(result).splitlines()
    )
    where = result.get("card") or result.get("gpu") or result.get("machine", {}).get("cpu", "")
    versions = result.get("versions") or {k: result[k] for k in ("torch", "triton", "cuda") if k in result}
    versions = ", ".join(f"{k} {v}" for k, v in versions.items())
    note = f"\n\n{result['partial']}" if "partial" in result else ""
    plot = path.with_suffix(".png")
    picture = f"\n\n![{path.stem}]({plot.relative_to(ROOT)})" if plot.exists() else ""
    return (
        f"{where}; {versions}; measured {result.get('date', '?')}; "
        f"from [`{path.relative_to(ROOT)}`]({path.relative_to(ROOT)}).{note}\n\n{body}{picture}"
    )


def section() -> str:
    parts = []
    sources = [
        (
            "layers-*.json",
            layers.table,
            "Layers on the GPU (fused kernel against eager, cuDNN with BN folded, "
            "torch.compile and the roofline floor)",
        ),
        ("gpu-models-*.json", gpu_models.table, "Whole models on the GPU"),
        ("cpu-models-*.json", cpu_models.table, "Whole models on the CPU (torch backend)"),
    ]
    for pattern, make_table, title in sources:
        complete, partial = runs(pattern)
        if not complete:
            parts.append(f"### {title}\n\nNot measured yet (no `benchmarks/results/{pattern}`).")
            continue
        blocks = [_block(p, make_table) for p in complete] + [_block(p, make_table) for p in partial]
        parts.append(f"### {title}\n\n" + "\n\n".join(blocks))
    return "\n\n".join(parts)


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{section()}\n{END}{tail}")
    print("README.md results section rewritten")


if __name__ == "__main__":
    main()
