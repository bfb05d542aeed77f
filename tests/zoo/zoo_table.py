"""The README's zoo table from the figures test_zoo writes: ``python tests/zoo/zoo_table.py results.jsonl``."""

from __future__ import annotations

import json
import sys


def table(lines: list[str]) -> str:
    rows = ["| model | source | task | chains fused | BNs folded / total | error vs float64 | known failures |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for line in lines:
        d = json.loads(line)
        failed = ", ".join(check for check, failure in d["failures"].items() if failure) or "-"
        rows.append(
            f"| {d['model']} | {d['source']} | {d['task']} | {d['fused']} | {d['bn_folded']} / {d['bn_total']} | "
            f"{d['rel_error']:.1e} | {failed} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table([line for line in f if line.strip()]))
