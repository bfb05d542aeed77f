"""The zoo's models as the ONNX files users bring, exported by torch.onnx both ways: the TorchScript exporter
(opset 17, BatchNorms kept as nodes, as a training-mode export leaves them) and the dynamo exporter, torch's default
(its default opset; it folds what it can itself and writes other forms: LeViT's reshapes, RepVGG's identity
BatchNorms beside folded convs). A dynamic batch, exported at batch 2 (the dynamo exporter fixes a batch of 1).
Each file is optimized by fuser and checked per model:

- onnxruntime: the optimized module matches onnxruntime running the file, at a batch size other than the
  exported one (ieee);
- chains: it fuses no fewer chains than optimizing the PyTorch model does;
- batch_norms: its export back to ONNX runs no more BatchNormalization nodes than the PyTorch model's
  optimization leaves unfolded;
- export: that export, run in onnxruntime, gives the file's answers.

Not here: the zoo's text models (tests/onnx/test_onnx_transformers.py exports them with both exporters and
padded masks), and torchvision's detectors, whose NMS the zoo replaces by a Python function
(tests/torchvision_shim.py) that torch.onnx cannot export.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from accuracy import TOLERANCE, rel_error
from export_checks import EXPORTER_WARNINGS
from torch.utils._pytree import tree_flatten

for _library in ("torchvision", "timm", "ultralytics", "transformers"):
    pytest.importorskip(_library, reason=f"the zoo needs {_library}: `make test` installs it (Makefile, extra 'zoo')")

from zoo_checks import one_thread  # noqa: E402
from zoo_models import ZOO, ZooModel  # noqa: E402

import fuser  # noqa: E402

pytestmark = [pytest.mark.slow, *EXPORTER_WARNINGS]

CHECKS = ["onnxruntime", "chains", "batch_norms", "export"]
EXPORTERS = ["torchscript", "dynamo"]
MODELS = [z for z in ZOO if not z.integer_input and not (z.source == "torchvision" and z.task == "detection")]

# (model, exporter, check) -> the bug that makes it fail today. strict: when a fix lands, the test says so.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}
# (model, exporter) -> why torch.onnx cannot write that file, and the error it raises: every check of the pair
# is expected to fail with that error, before fuser sees the file (strict: a fixed exporter makes them pass).
EXPORT_FAILURES: dict[tuple[str, str], tuple[str, type[Exception]]] = {
    ("timm eva02_tiny_patch14_224", "torchscript"): (
        "torch.onnx's TorchScript exporter fails in timm's EVA attention: scaled_dot_product_attention is given "
        "is_causal as a tensor",
        TypeError,
    ),
}


def _ort(path: Path, x: torch.Tensor) -> list[torch.Tensor]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(np.asarray(o)) for o in session.run(None, {session.get_inputs()[0].name: x.numpy()})]


def _batch_norm_nodes(path: Path) -> int:
    return sum(node.op_type == "BatchNormalization" for node in onnx.load(str(path)).graph.node)


def _mismatch(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> str | None:
    if len(got) != len(expected):
        return f"{what}: {len(got)} outputs, onnxruntime gives {len(expected)}"
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a.shape != b.shape:
            return f"{what}: output {k} has shape {tuple(a.shape)}, onnxruntime {tuple(b.shape)}"
        error = rel_error(a, b) if b.dtype.is_floating_point else float(not torch.equal(a, b))
        if error >= TOLERANCE["ieee"]:
            return f"{what}: output {k} is {error:.1e} from onnxruntime"
    return None


@functools.cache
def _evaluate(name: str, exporter: str, folder: Path) -> dict[str, str | None]:
    """The checks of one model, on one thread (zoo_checks.one_thread).

    The model's files are deleted once all its checks pass: the zoo's files come to about 4 GB, more than a CI
    machine may have free. A model with a failed check keeps them, for a look at what went wrong.
    """
    folder.mkdir(exist_ok=True)  # a model whose checks raised is tried again by its next check
    with one_thread():
        results = _checks(name, exporter, folder)
    if all(failure is None for failure in results.values()):
        shutil.rmtree(folder)
    return results


def _export(model: torch.nn.Module, x: torch.Tensor, path: Path, exporter: str) -> None:
    common = {"input_names": ["x"], "dynamic_axes": {"x": {0: "N"}}}
    if exporter == "dynamo":
        torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False, **common)
    else:
        torch.onnx.export(model, (x,), str(path), opset_version=17, dynamo=False, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.PRESERVE, **common)  # fmt: skip


def _checks(name: str, exporter: str, folder: Path) -> dict[str, str | None]:
    zoo: ZooModel = next(z for z in MODELS if z.name == name)
    model, x = zoo.build(), zoo.example_input()
    x = torch.cat([x, 0.5 * x + 0.1]) if x.shape[0] == 1 else x
    run = torch.randn((x.shape[0] + 1, *x.shape[1:]), generator=torch.Generator().manual_seed(3))  # another batch
    path, back = folder / "model.onnx", folder / "model.opt.onnx"
    from_torch = fuser.explain(model, (x,))  # first: an export can leave fake tensors in the model's caches
    _export(model, x, path, exporter)
    optimized = fuser.optimize(str(path), (run,), precision="ieee")
    with torch.no_grad():
        got, _ = tree_flatten(optimized(run))
    expected = _ort(path, run)
    fuser.export_onnx(optimized, (run,), str(back))
    left = sum(chain.pattern == "batch_norm" for chain in from_torch.rejected)
    found = _batch_norm_nodes(back)
    fused, fused_from_torch = len(optimized.fusion_report.fused), len(from_torch.fused)
    return {
        "onnxruntime": _mismatch(got, expected, "the optimized file"),
        "chains": None if fused >= fused_from_torch else f"{fused} chains fused, {fused_from_torch} from PyTorch",
        "batch_norms": None if found <= left else f"{found} BatchNormalization nodes, {left} left from PyTorch",
        "export": _mismatch(_ort(back, run), expected, "the export of the optimized file"),
    }


def _cases() -> list[Any]:
    cases = []
    for zoo in MODELS:
        for exporter in EXPORTERS:
            for check in CHECKS:
                reason = KNOWN_FAILURES.get((zoo.name, exporter, check))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                if (zoo.name, exporter) in EXPORT_FAILURES:
                    why, error = EXPORT_FAILURES[zoo.name, exporter]
                    marks = [pytest.mark.xfail(strict=True, raises=error, reason=why)]
                cases.append(pytest.param(zoo.name, exporter, check, marks=marks, id=f"{zoo.name}-{exporter}-{check}"))
    return cases


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo_onnx")


@pytest.mark.parametrize(("name", "exporter", "check"), _cases())
def test_zoo_from_onnx(name: str, exporter: str, check: str, folder: Path) -> None:
    model_folder = folder / f"{name}-{exporter}".replace(" ", "_").replace("(", "").replace(")", "")
    failure = _evaluate(name, exporter, model_folder)[check]
    assert failure is None, f"{name} ({exporter} export): {check}: {failure}"
