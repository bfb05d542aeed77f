"""export_onnx writes standard ONNX that passes onnx.checker, keeps the batch dynamic, matches the module
in onnxruntime, and writes atomically: a failure leaves nothing at the output path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from accuracy import TOLERANCE, randomize_batchnorm, rel_error
from onnx import helper
from onnx_testing import const, info, make_model, random_feeds, run_ort
from torch import nn

from fuser.onnx.errors import OnnxExportError
from fuser.onnx.exporter import export_onnx
from fuser.onnx.importer import import_onnx


class ConvBnSiluHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 7, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(7)
        self.fc = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


class TwoInTwoOut(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a + b
        return torch.relu(s), s.reshape(s.shape[0], -1) * 0.5


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("forward refuses")


class Unexportable(nn.Module):
    """torch.onnx has no ONNX form of aten::linalg_svd."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.svd(x)[0]


def seeded_head() -> nn.Module:
    module = ConvBnSiluHead()
    return randomize_batchnorm(module, torch.Generator().manual_seed(0)).eval()


def batch_dim(value: onnx.ValueInfoProto) -> str:
    return value.type.tensor_type.shape.dim[0].dim_param


def assert_matches(module: nn.Module, path: Path, inputs: tuple[torch.Tensor, ...]) -> None:
    names = [i.name for i in onnx.load(path).graph.input]
    ref = run_ort(str(path), {n: t.numpy() for n, t in zip(names, inputs, strict=True)})
    with torch.no_grad():
        out = module(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    for k, (o, r) in enumerate(zip(outs, ref, strict=True)):
        err = rel_error(torch.from_numpy(r), o)
        assert err < TOLERANCE["ieee"], f"output {k}: relative error {err:.2e}"


def test_export_checks_and_runs_at_another_batch(tmp_path: Path) -> None:
    module = seeded_head()
    path = export_onnx(module, (torch.randn(2, 3, 11, 9),), tmp_path / "head.onnx")
    assert path == tmp_path / "head.onnx"
    model = onnx.load(path)
    onnx.checker.check_model(model)
    assert [batch_dim(v) for v in (*model.graph.input, *model.graph.output)] == ["batch", "batch"]
    assert_matches(module, path, (torch.randn(5, 3, 11, 9),))


def test_two_inputs_two_outputs(tmp_path: Path) -> None:
    module = TwoInTwoOut()
    path = export_onnx(module, (torch.randn(2, 3, 5), torch.randn(2, 3, 5)), tmp_path / "two.onnx", opset=13)
    model = onnx.load(path)
    assert [v.name for v in model.graph.input] == ["input_0", "input_1"]
    assert [v.name for v in model.graph.output] == ["output_0", "output_1"]
    assert model.opset_import[0].version == 13
    assert_matches(module, path, (torch.randn(4, 3, 5), torch.randn(4, 3, 5)))


def test_the_module_is_not_modified(tmp_path: Path) -> None:
    module = seeded_head().train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    export_onnx(module, (torch.randn(2, 3, 11, 9),), tmp_path / "m.onnx")
    assert module.training
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_failing_forward_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="forward refuses"):
        export_onnx(Fails(), (torch.randn(2, 3),), tmp_path / "f.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_export_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous contents")
    with pytest.raises(OnnxExportError, match=rf"exporting Unexportable to {path} at opset 17 failed"):
        export_onnx(Unexportable(), (torch.randn(2, 3),), path)
    assert path.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        export_onnx(lambda x: x, (torch.randn(2),), tmp_path / "a.onnx")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of tensors"):
        export_onnx(TwoInTwoOut(), ([1, 2],), tmp_path / "a.onnx")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_onnx(seeded_head(), (torch.randn(2, 3, 5, 5),), tmp_path / "missing" / "a.onnx")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        export_onnx(seeded_head(), (torch.randn(2, 3, 5, 5),), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_import_then_export_keeps_the_batch_dynamic(tmp_path: Path) -> None:
    """An imported graph with run-time shape arithmetic exports back with a dynamic batch: the sizes are
    ``x.size(0)`` nodes, which the exporter records as Shape ops, not as the traced batch size."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["c", "shape"], ["y"]),
    ]
    inits = [
        const("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        const("zero", np.int64(0)),
        const("axes", [0]),
        const("minus1", [-1]),
    ]
    model = make_model(nodes, [info("x", ["N", 3, 7, 5])], [info("y", ["N", 140])], inits, opset=13)
    module = import_onnx(model)
    path = export_onnx(module, (torch.randn(2, 3, 7, 5),), tmp_path / "roundtrip.onnx")
    feeds = random_feeds(model, 5)
    (expected,) = run_ort(model, feeds)
    (got,) = run_ort(str(path), {"input_0": feeds["x"]})
    assert got.shape == (5, 140)
    assert rel_error(torch.from_numpy(got), torch.from_numpy(expected)) < TOLERANCE["ieee"]
