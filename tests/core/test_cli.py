"""The `fuser` command line: explain and optimize, on bundled models and ONNX files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

from fuser import cli, models


def test_help_lists_the_commands():
    done = subprocess.run([sys.executable, "-m", "fuser.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("explain", "optimize", "demo"):
        assert command in done.stdout


def test_explain_bundled_model_as_json(capsys):
    assert cli.main(["explain", "resnet26", "--input-shape", "1,3,35,33", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["fused"]) == models.build("resnet26").expected_fusions
    assert report["fused"][0]["pattern"] == "conv_bn_act"


def test_optimize_to_pt_and_onnx(tmp_path: Path, capsys):
    pt, onnx_path = tmp_path / "m.pt", tmp_path / "m.onnx"
    assert cli.main(["optimize", "resnet26", "--input-shape", "2,3,35,33", "-o", str(pt), "--device", "cpu"]) == 0
    assert cli.main(["optimize", "resnet26", "--input-shape", "2,3,35,33", "-o", str(onnx_path)]) == 0
    assert "chains fused" in capsys.readouterr().out
    loaded = torch.load(pt, weights_only=False)
    x = torch.randn(2, 3, 35, 33)
    with torch.no_grad():
        assert torch.allclose(loaded(x), models.build("resnet26")(x), rtol=1e-4, atol=1e-5)
    graph = onnx.load(str(onnx_path)).graph
    assert not any(n.op_type == "BatchNormalization" for n in graph.node)


def test_explain_onnx_file_takes_input_shapes_from_the_graph(tmp_path: Path, capsys):
    source = tmp_path / "src.onnx"
    model = models.build("resnet26", width=8)
    torch.onnx.export(
        model,
        (torch.randn(1, 3, 35, 33),),
        str(source),
        dynamo=False,
        input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )
    assert cli.main(["explain", str(source)]) == 0
    assert "conv_act" in capsys.readouterr().out  # the default export folds BN into the convs


def test_bad_arguments_are_named(tmp_path: Path):
    with pytest.raises(SystemExit, match="no such file, and not a bundled model"):
        cli.main(["explain", str(tmp_path / "missing.onnx")])
    with pytest.raises(SystemExit, match=r"write \.onnx or \.pt"):
        cli.main(["optimize", "resnet26", "--input-shape", "1,3,32,32", "-o", str(tmp_path / "m.txt")])
    with pytest.raises(SystemExit):
        cli.main(["explain", "resnet26", "--input-shape", "1,3,0,32"])
