"""The tile table shipped for sm90 (kernels/tile_table_sm90.json) is what the loader reads: a measured
table, every entry keyed by the shape class of the shapes it was measured on, every config a valid tile."""

from __future__ import annotations

import json

from fuser.kernels import tile_table
from fuser.kernels.tile_config import Problem


def test_the_shipped_sm90_table_loads_and_is_consistent() -> None:
    path = tile_table.table_path("sm90")
    data = json.loads(path.read_text())
    assert data["format"] == tile_table.TABLE_FORMAT and data["arch"] == "sm90"
    for field in ("gpu", "torch", "triton", "date", "command", "measured"):
        assert data["source"].get(field), f"the table's source lacks {field!r}"
    tile_table.forget_loaded()
    entries = tile_table.load("sm90")
    assert len(entries) == len(data["entries"]) > 50
    for cls, entry in entries.items():
        kernel, precision, operand, *_ = cls.split("|")
        for m, n, k, groups in entry["shapes"]:
            problem = Problem(m, n, k, groups, int(operand[1:]), precision)
            assert tile_table.shape_class(kernel, problem) == cls
        configs = [tile_table.config_from_dict(r["config"]) for r in entry["ranked"]]
        assert configs and None not in configs, f"{cls}: a ranked config is not a TileConfig"
        rels = [r["rel"] for r in entry["ranked"]]  # geometric means over the class's shapes of time / best
        assert rels == sorted(rels) and rels[0] >= 1.0, f"{cls}: not ranked fastest first: {rels}"
