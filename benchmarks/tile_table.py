"""Measure the kernels' tile candidates on representative shapes and write the table the kernels ship
(kernels/tile_table_<arch>.json), which is their default where no tuning run was made. GPU only.

    python -m benchmarks.tile_table [--cache DIR] [--out FILE] [--only yolov8n:1:float32 ...]
        [--budget-s 540] [--per-class 2] [--rounds 2] [--rep-ms 40] [--build-only] [--extend TABLE]
    python -m benchmarks.tile_table --from-sweep results/conv-tile-sweep-*.json [--out FILE]   # default: in place

What it measures: YOLOv8n @640, ResNet-50, EfficientNet-B0 and MobileNetV3-Large @224 (from ultralytics /
torchvision where installed, else the same architectures from fuser.models; MobileNetV3 only from
torchvision), each at batch 1 and 32 in float32 (TF32) and float16, channels_last, through
``fuser.optimize(..., tune=True)``, so every launch signature a model reaches is planned as in real use;
then GEMM shapes (transformer blocks, classifier heads, a large square one) through ``gemm_act``. Each
measured launch records every candidate's time in the tile cache (``--cache``). To keep the run short, at
most ``--per-class`` launches per shape class (tile_table.shape_class) and kinds of tile offered (shifted
taps, boxes) are measured; the others take the default. The table is then built from every entry of the
cache measured on this GPU (tile_table.build_table) and written with where it came from; the summary says
how far the cost model's pick was from the best.

``--from-sweep FILE ...`` (CPU or GPU) adds the configs that benchmarks/conv_tile_sweep.py forced on single
layers instead (its 'late' group; each config's best time over the files): a class the sweep measured on every
shape of gets the sweep's ranking, a new class is added, a class with shapes the sweep did not measure is kept.

A run cut short (``--budget-s``, or the device's limit per call) keeps its measurements in the cache and
records the items it finished there: the same command again resumes where it stopped. The table is
rewritten after every item. ``--budget-s`` only stops new items from starting, and one item (a model at
batch 32) can take a few minutes: keep it that much below an outside time limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import fuser
from fuser.kernels import autotune, pack_gemm_weight, tile_table
from fuser.kernels.gemm import gemm_act
from fuser.kernels.tile_config import Problem, TileConfig

REPO = Path(__file__).resolve().parent.parent
# (model, batch, dtype), most wanted first: the regimes the kernels' targets name come before the others.
MODEL_ITEMS = [
    (model, batch, dtype)
    for batch, dtype in ((1, "float32"), (32, "float16"), (32, "float32"), (1, "float16"))
    for model in ("yolov8n", "resnet50", "efficientnet_b0", "mobilenet_v3_large")
]
# (m, k, n): BERT/ViT-base blocks at 128 and 4096 tokens, classifier heads at batch 1 and 32, a large GEMM.
GEMM_SHAPES = [
    (128, 768, 3072),
    (128, 3072, 768),
    (128, 768, 768),
    (4096, 768, 3072),
    (4096, 3072, 768),
    (1, 1280, 1000),
    (32, 2048, 1000),
    (8192, 4096, 16384),
]
SIZES = {"yolov8n": 640}


def _build(name: str) -> tuple[torch.nn.Module, str]:
    """The model as its library builds it where installed, else fuser.models' version of the architecture."""
    if name == "yolov8n":
        try:
            from ultralytics.nn.tasks import DetectionModel

            return DetectionModel("yolov8n.yaml", verbose=False).eval(), "ultralytics"
        except ImportError:
            pass
    else:
        try:
            import torchvision

            return getattr(torchvision.models, name)(weights=None).eval(), "torchvision"
        except ImportError:
            pass
    from fuser import models

    if name not in models.MODELS:
        raise LookupError(f"{name} needs torchvision, which is not installed")
    return models.build(name), "fuser.models"


def _tune_model(name: str, batch: int, dtype: str) -> str:
    model, source = _build(name)
    torch_dtype = getattr(torch, dtype)
    size = SIZES.get(name, 224)
    model = model.to(device="cuda", dtype=torch_dtype, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device="cuda", dtype=torch_dtype).contiguous(
        memory_format=torch.channels_last
    )
    fuser.optimize(model, (x,), precision="tf32" if torch_dtype == torch.float32 else "fp16", tune=True)
    return source


def _tune_gemms(dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch_dtype)
        w = pack_gemm_weight(
            torch.randn(n, k, device="cuda", dtype=torch_dtype), "tf32" if dtype == "float32" else "fp16"
        )
        with torch.no_grad():
            gemm_act(a, w)


def _tile_kinds(configs: Iterable[TileConfig | None]) -> frozenset[tuple[bool, bool]]:
    """The kinds of tile a candidate list offers: (shifted taps, box tiles) of each config."""
    return frozenset((bool(c.tap_shift), bool(c.box_w)) for c in configs if c is not None)


def _class_limit(cache_file: Path, per_class: int) -> Callable[[str, Problem | None, Sequence[TileConfig]], bool]:
    """A ``should_measure`` that lets at most ``per_class`` launches of each shape class and kinds of tile
    offered be measured, counting what the cache already holds. Counting the kinds too keeps a stage's
    stride-1 3x3 convs, whose lists add shifted taps, from being left out behind the stride-2 conv of the same
    GEMM shape that comes first."""
    counts: Counter[tuple[str, frozenset[tuple[bool, bool]]]] = Counter()
    for entry in autotune.read_cache_file(cache_file).values():
        if entry.get("problem"):
            try:
                cls = tile_table.shape_class(entry["kernel"], Problem(**entry["problem"]))
                kinds = _tile_kinds(tile_table.config_from_dict(c) for c, _ in entry["timings_ms"])
            except (TypeError, ValueError, KeyError):
                continue
            counts[cls, kinds] += 1

    def should_measure(kernel: str, problem: Problem | None, candidates: Sequence[TileConfig]) -> bool:
        if problem is None:
            return True
        key = (tile_table.shape_class(kernel, problem), _tile_kinds(candidates))
        if counts[key] >= per_class:
            return False
        counts[key] += 1
        return True

    return should_measure


def _summary(table: dict[str, Any]) -> str:
    entries = table["entries"]
    parts = [f"{len(entries)} shape classes"]
    for field, who in (("model_rel", "the cost model's pick"), ("first_rel", "the lists' first candidates")):
        rel = [e[field] for e in entries.values() if e.get(field) is not None]
        failing = sum(e.get(field) is None for e in entries.values())
        if not rel:
            continue
        geomean = math.exp(sum(math.log(v) for v in rel) / len(rel))
        worst_class, worst = max(entries.items(), key=lambda item: item[1].get(field) or 0.0)
        parts.append(
            f"{who} against the measured best: geomean {geomean:.3f}x, worst {worst[field]:.3f}x ({worst_class}), "
            f"within 5% on {sum(v <= 1.05 for v in rel)}/{len(rel)}"
            + (f", a failing config on {failing}" if failing else "")
        )
    return "; ".join(parts)


def merge_sweeps(table: dict[str, Any], sweeps: list[Path], sm_count: int = 132) -> tuple[dict[str, Any], list[str]]:
    """``table`` with the classes measured by conv_tile_sweep results ``sweeps`` (module docstring), and what
    was done per class. Measurements of one problem in several files keep each config's best time."""
    from benchmarks.conv_tile_sweep import cache_entries

    best: dict[tuple[str, str], dict[str, Any]] = {}
    sources = []
    for path in sweeps:
        result = json.loads(path.read_text())
        sources.append({"file": path.name, "date": result.get("date"), "card": result.get("card"),
                        "versions": result.get("versions")})  # fmt: skip
        for entry in cache_entries(result):
            key = (entry["kernel"], json.dumps(entry["problem"], sort_keys=True))
            held = best.setdefault(key, {**entry, "timings_ms": []})
            times = {json.dumps(c, sort_keys=True): t for c, t in held["timings_ms"]}
            for config, t in entry["timings_ms"]:
                name = json.dumps(config, sort_keys=True)
                old_t = times.get(name)
                times[name] = t if old_t is None else old_t if t is None else min(old_t, t)
            held["timings_ms"] = [[json.loads(c), t] for c, t in times.items()]
    built = tile_table.build_table(best.values(), table.get("arch", "sm90"), {}, sm_count)["entries"]
    entries, done = dict(table["entries"]), []
    for cls, entry in sorted(built.items()):
        old = entries.get(cls)
        if old is not None and not {tuple(s) for s in old["shapes"]} <= {tuple(s) for s in entry["shapes"]}:
            done.append(f"{cls}: kept (the table also measured {old['shapes']})")
            continue
        entries[cls] = entry
        done.append(f"{cls}: {'replaced' if old is not None else 'added'}")
    earlier = [s for s in table.get("source", {}).get("sweeps", []) if s["file"] not in {n["file"] for n in sources}]
    source = {**table.get("source", {}), "sweeps": [*earlier, *sources]}
    return {**table, "entries": entries, "source": source}, done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", type=Path, default=REPO / ".fuser_autotune" / "tile_table", help="tile cache of the measurements"
    )
    parser.add_argument("--out", type=Path, default=None, help="the table (default: kernels/tile_table_<arch>.json)")
    parser.add_argument("--only", nargs="*", default=None, help="items as model:batch:dtype, or gemm:float32 ...")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new item after this long")
    parser.add_argument("--per-class", type=int, default=2, help="launches measured per shape class")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each candidate (best kept)")
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench time per measurement")
    parser.add_argument("--build-only", action="store_true", help="only build the table from the cache")
    parser.add_argument(
        "--extend", type=Path, default=None, help="a table whose entries are kept for classes this run did not measure"
    )
    parser.add_argument("--from-sweep", nargs="+", type=Path, help="conv_tile_sweep results to add (no GPU needed)")
    args = parser.parse_args(argv)
    if args.from_sweep:
        shipped = tile_table.table_path("sm90")  # the sweeps ran on an H200
        table, done = merge_sweeps(json.loads(shipped.read_text()), args.from_sweep)
        out = args.out or shipped
        out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print("\n".join(done) + f"\nwrote {out}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("tile_table: needs a CUDA GPU")
    os.environ.pop("FUSER_AUTOTUNE", None)  # "0" would switch the measuring off
    name, arch, sm_count = autotune.device_facts(torch.device("cuda"))
    args.cache.mkdir(parents=True, exist_ok=True)
    autotune.set_cache_dir(args.cache)
    cache_file = autotune.cache_file(name)
    done_file = args.cache / "tile_table_done.json"
    done = set(json.loads(done_file.read_text())) if done_file.exists() else set()
    items = [f"{m}:{b}:{d}" for m, b, d in MODEL_ITEMS] + ["gemm:float32", "gemm:float16"]
    if args.only:
        items = [i for i in items if i in args.only]
    left_out: list[str] = []
    start = time.perf_counter()
    sources: dict[str, str] = {}
    out = args.out or tile_table.table_path(arch)

    def write_table() -> dict[str, Any]:
        entries = [
            e
            for e in autotune.read_cache_file(cache_file).values()
            if json.loads(e.get("key", "{}")).get("arch") == arch
        ]
        source = {
            "gpu": name,
            "sm_count": sm_count,
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(),
            "command": "python -m benchmarks.tile_table " + " ".join(sys.argv[1:] if argv is None else argv),
            "measured": sorted(done),
            "models_from": sources,
            "left_out": left_out,
            "per_class": args.per_class,
            "rounds": args.rounds,
            "rep_ms": args.rep_ms,
        }
        table = tile_table.build_table(entries, arch, source, sm_count)
        if args.extend is not None:
            # The classes this run measured replace the old table's; the old source stays, under "extends".
            old = json.loads(args.extend.read_text())
            table["entries"] = {**old["entries"], **table["entries"]}
            table["source"]["extends"] = old["source"]
        out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        return table

    for item in [] if args.build_only else items:
        if item in done:
            continue
        if time.perf_counter() - start > args.budget_s:
            left_out.append(item)
            continue
        print(f"== {item}", file=sys.stderr, flush=True)
        should_measure = _class_limit(cache_file, args.per_class)
        with autotune.tuning(rounds=args.rounds, rep_ms=args.rep_ms, should_measure=should_measure):
            try:
                if item.startswith("gemm:"):
                    _tune_gemms(item.split(":")[1])
                else:
                    model, batch, dtype = item.split(":")
                    sources[model] = _tune_model(model, int(batch), dtype)
            except Exception as error:  # one model that fails (a missing library, out of memory) ends only its item
                print(f"{item}: left out ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
                left_out.append(item)
                continue
        done.add(item)
        done_file.write_text(json.dumps(sorted(done)))
        write_table()  # after every item: a run stopped from outside still leaves the table of what it did
    table = write_table()
    print(f"wrote {out}: {_summary(table)}", flush=True)
    if left_out:
        print(f"left out (run the same command again to resume): {', '.join(left_out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
