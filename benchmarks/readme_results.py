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


def newest(pattern: str) -> Path | None:
    found = sorted(RESULTS.glob(pattern))
    return found[-1] if found else None


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
        path = newest(pattern)
        if path is None:
            parts.append(f"### {title}\n\nNot measured yet (no `benchmarks/results/{pattern}`).")
            continue
        result = json.loads(path.read_text())
        body = "\n".join(
            "####" + line.lstrip("#") if line.startswith("#") else line for line in make_table(result).splitlines()
        )
        where = result.get("card") or result.get("gpu") or result.get("machine", {}).get("cpu", "")
        versions = result.get("versions") or {k: result[k] for k in ("torch", "triton", "cuda") if k in result}
        versions = ", ".join(f"{k} {v}" for k, v in versions.items())
        parts.append(
            f"### {title}\n\n{where}; {versions}; measured {result.get('date', '?')}; "
            f"from [`{path.relative_to(ROOT)}`]({path.relative_to(ROOT)}).\n\n{body}"
        )
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
