"""The warp stall reasons of an Nsight Compute raw-page CSV (``ncu --csv --page raw``), largest first.

Each ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`` is how many warps wait for ``<reason>``
per instruction issued: they add up to the warp cycles per issued instruction, so the list says what an
issue-bound or latency-bound kernel spends its cycles on.

    python -m benchmarks.stall_reasons REPORT.csv
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def stall_reasons(report: Path) -> list[tuple[str, str, float]]:
    """``(kernel, reason, warps per issued instruction)`` for every kernel of the report, each kernel's
    reasons largest first. Lines before the CSV header (ncu's ``==PROF==`` notes) are skipped."""
    lines = report.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f'{report}: no raw-page CSV header (a line starting with "ID"); was it --page raw?')
    rows = list(csv.reader(lines[start:]))
    header, data = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]  # rows[1] holds the units
    name_col = header.index("Kernel Name")
    found = []
    for row in data:
        reasons = []
        for col, metric in enumerate(header):
            match = STALL.fullmatch(metric)
            value = _number(row[col]) if match else None
            if match and value is not None:
                reasons.append((row[name_col], match.group(1), value))
        found.extend(sorted(reasons, key=lambda r: -r[2]))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    args = parser.parse_args(argv)
    reasons = stall_reasons(args.report)
    if not reasons:
        print(f"{args.report}: no stall-reason metrics in the report")
        return 1
    total: dict[str, float] = {}
    for kernel, _, value in reasons:
        total[kernel] = total.get(kernel, 0.0) + value
    for kernel, reason, value in reasons:
        print(f"{kernel[:40]:40s} {reason:28s} {value:7.2f}  {100 * value / total[kernel]:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
