"""Reference models exported by torch.onnx, with BN kept and with BN folded, import and match onnxruntime
at a batch size other than the exported one; optimized, they fuse every chain the torch model has, and
their export runs in onnxruntime with the same result.

The models are small inputs of the fuser.models zoo (every chain kind: conv-BN-ReLU with residuals,
SiLU and squeeze-excite, a detector head's shape arithmetic, attention with LayerNorm and GELU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from accuracy import TOLERANCE, rel_error
from onnx_testing import assert_survives_pickling, run_ort

import fuser
from fuser.models import build, example_input
from fuser.onnx.exporter import export_onnx
from fuser.onnx.importer import import_onnx

pytestmark = [
    pytest.mark.slow,
    # The TorchScript exporter is used on purpose (as fuser.onnx.exporter does); its notices are noise here.
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),
]

# name: (input size, build kwargs, opset). BERT at opset 20 exports GELU as the Gelu op.
MODELS = {
    "resnet26": (64, {}, 17),
    "efficientnet_b0": (64, {}, 17),
    "yolov8n": (64, {}, 17),
    "vit_tiny": (32, {"img_size": 32}, 17),
    "bert_tiny": (16, {}, 20),
}
CLASSIFIERS = {"resnet26", "efficientnet_b0", "vit_tiny"}
EXPORT_BATCH, RUN_BATCH = 2, 3


@dataclass
class Exported:
    name: str
    model: torch.nn.Module
    size: int
    bn_kept: Path
    bn_folded: Path

    def run_input(self) -> torch.Tensor:
        return example_input(self.name, batch=RUN_BATCH, size=self.size, seed=1)


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    name = request.param
    size, kwargs, opset = MODELS[name]
    model = build(name, **kwargs)
    x = example_input(name, batch=EXPORT_BATCH, size=size)
    folder = tmp_path_factory.mktemp(name)
    common = dict(input_names=["x"], dynamic_axes={"x": {0: "N"}}, opset_version=opset, dynamo=False)
    kept, folded = folder / "bn_kept.onnx", folder / "bn_folded.onnx"
    torch.onnx.export(model, (x,), kept, training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False, **common)
    torch.onnx.export(model, (x,), folded, **common)
    return Exported(name, model, size, kept, folded)


def assert_like_onnxruntime(out: torch.Tensor, path: Path, x: torch.Tensor, name: str, what: str) -> None:
    (ref,) = run_ort(str(path), {"x": x.numpy()})
    ref_t = torch.from_numpy(ref)
    assert out.shape == ref_t.shape, f"{what}: shape {tuple(out.shape)} vs onnxruntime {ref.shape}"
    err = rel_error(out, ref_t)
    assert err < TOLERANCE["ieee"], f"{what}: relative error {err:.2e} against onnxruntime"
    if name in CLASSIFIERS:
        assert torch.equal(out.argmax(-1), ref_t.argmax(-1)), f"{what}: top-1 labels differ from onnxruntime"


@pytest.mark.parametrize("variant", ["bn_kept", "bn_folded"])
def test_import_matches_onnxruntime(exported: Exported, variant: str) -> None:
    path = getattr(exported, variant)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in exported.model.modules())
    assert ("BatchNormalization" in ops) == (has_bn and variant == "bn_kept"), f"{variant} export has {ops}"
    module = import_onnx(path)
    x = exported.run_input()
    with torch.no_grad():
        out = module(x)
    assert_like_onnxruntime(out, path, x, exported.name, f"{exported.name} {variant}")
    assert_survives_pickling(module, {"x": x.numpy()})


def test_optimized_fuses_every_chain_and_exports(exported: Exported, tmp_path: Path) -> None:
    """From the BN-kept file: as many fused chains as the torch model has, the same result as onnxruntime,
    and an exported file without BatchNormalization that onnxruntime runs the same at another batch."""
    fused = fuser.optimize(exported.bn_kept, precision="ieee", backend="torch")
    report = fused.fusion_report
    assert len(report.fused) == exported.model.expected_fusions, str(report)
    x = exported.run_input()
    with torch.no_grad():
        out = fused(x)
    assert_like_onnxruntime(out, exported.bn_kept, x, exported.name, f"{exported.name} optimized")

    example = example_input(exported.name, batch=EXPORT_BATCH, size=exported.size)
    path = export_onnx(fused, (example,), tmp_path / "optimized.onnx")
    model = onnx.load(path)
    assert "BatchNormalization" not in {n.op_type for n in model.graph.node}
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    (got,) = run_ort(str(path), {"input_0": x.numpy()})
    assert_like_onnxruntime(torch.from_numpy(np.asarray(got)), exported.bn_kept, x, exported.name, "exported")


def test_bert_below_opset_20_fuses_its_written_out_tanh_gelu(tmp_path: Path) -> None:
    """Below opset 20 torch writes GELU(approximate="tanh") out as Mul/Add/Tanh nodes; both feed-forward
    chains must still fuse with a tanh-GELU epilogue and match onnxruntime."""
    model = build("bert_tiny")
    path = tmp_path / "bert_opset17.onnx"
    x = example_input("bert_tiny", batch=EXPORT_BATCH, size=16)
    axes = {"x": {0: "N"}}
    torch.onnx.export(model, (x,), path, input_names=["x"], dynamic_axes=axes, opset_version=17, dynamo=False)
    assert "Tanh" in {n.op_type for n in onnx.load(str(path)).graph.node}
    optimized = fuser.optimize(path, backend="torch")
    report = optimized.fusion_report
    assert len(report.fused) == model.expected_fusions, str(report)
    assert sum(e.activation == "gelu_tanh" for e in report.fused) == 2, str(report)
    x_run = example_input("bert_tiny", batch=RUN_BATCH, size=16, seed=1)
    with torch.no_grad():
        assert_like_onnxruntime(optimized(x_run), path, x_run, "bert_tiny", "bert opset 17, optimized")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["yolov8n", "vit_tiny"])
def test_dynamo_export_imports_and_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    """torch.onnx's dynamo exporter writes other graphs than the TorchScript one (no Constant nodes,
    shape arithmetic folded, ReduceMean's axes as an input): they import and match onnxruntime too. The
    detector (shape arithmetic, Split, Resize) and the transformer (attention) are the two kinds that
    differ; the CNN classifiers export to the same Conv chains either way (each takes ~20 s to export)."""
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    size, kwargs, _ = MODELS[name]
    model = build(name, **kwargs)
    path = tmp_path / f"{name}.onnx"
    shapes = ({0: torch.export.Dim("batch")},)
    x = example_input(name, batch=EXPORT_BATCH, size=size)
    torch.onnx.export(model, (x,), path, input_names=["x"], dynamic_shapes=shapes, opset_version=18, dynamo=True)
    module = import_onnx(path)
    x_run = example_input(name, batch=RUN_BATCH, size=size, seed=1)
    with torch.no_grad():
        out = module(x_run)
    assert_like_onnxruntime(out, path, x_run, name, f"{name} dynamo export")


@pytest.mark.parametrize("name", ["yolov8n", "vit_tiny", "bert_tiny"])
def test_optimized_export_is_no_larger_than_its_input(name: str, tmp_path: Path) -> None:
    """ONNX in, optimize, ONNX out: the file written has at most as many nodes as the one read. Shape
    arithmetic over the fixed sizes (the detector's anchor grids and strides, attention's head reshapes)
    folds at import time instead of being re-expanded into Shape/Gather/Concat chains; the output still
    matches onnxruntime on the input file at another batch size. (The CNN classifiers have no shape
    arithmetic: their exports are Conv chains of the same length either way.)"""
    size, kwargs, opset = MODELS[name]
    model = build(name, **kwargs)
    x = example_input(name, batch=EXPORT_BATCH, size=size)
    source = tmp_path / f"{name}.onnx"
    axes = {"x": {0: "N"}}
    torch.onnx.export(model, (x,), source, input_names=["x"], dynamic_axes=axes, opset_version=opset, dynamo=False)
    optimized = fuser.optimize(source, precision="ieee", backend="torch")
    path = export_onnx(optimized, (x,), tmp_path / "optimized.onnx")
    nodes_in, nodes_out = len(onnx.load(source).graph.node), len(onnx.load(path).graph.node)
    assert nodes_out <= nodes_in, f"{name}: the optimized export has {nodes_out} nodes, its input {nodes_in}"
    x_run = example_input(name, batch=RUN_BATCH, size=size, seed=1)
    (got,) = run_ort(str(path), {"input_0": x_run.numpy()})
    assert_like_onnxruntime(torch.from_numpy(np.asarray(got)), source, x_run, name, f"{name} optimized export")
