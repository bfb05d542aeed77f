"""ONNX out: an (optimized) module becomes a standard ONNX file that onnxruntime runs.

Fused modules call ``fuser::`` custom ops that no ONNX runtime knows. Inside ``fuser.lower.ops.decomposed()``
they run their reference code instead (conv with the folded weights and bias, then the activation; a
linear then its epilogue), so the TorchScript exporter records only standard ops: Conv + activation
nodes, Gemm or MatMul + Add + activation, and no BatchNormalization for a folded chain.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from fuser.onnx.errors import OnnxExportError

# Opset 17 has LayerNormalization and is read by every onnxruntime of the last years.
DEFAULT_OPSET = 17
BATCH_AXIS_NAME = "batch"


def export_onnx(
    module: nn.Module,
    example_inputs: tuple,
    path: str | os.PathLike,
    *,
    opset: int | None = None,
) -> Path:
    """Export ``module`` to ``path`` as ONNX and return the path.

    ``example_inputs`` is the tuple of tensors ``module`` is called with; their values only drive the
    trace. Dim 0 of every input and output is exported as a dynamic ``batch`` axis. The file passes
    ``onnx.checker`` before it appears: the export goes to a temporary file in the target folder that
    replaces ``path`` only on success, so a failure leaves nothing (and no half-written file) there.
    The module is not modified (the exporter switches it to eval mode for the trace and back).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"export_onnx expects an nn.Module, got {type(module).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise TypeError("export_onnx expects example_inputs as a tuple of tensors")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"export_onnx: {path} is a folder; give a file path such as {path / 'model.onnx'}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"export_onnx: folder {path.parent} does not exist")
    opset = DEFAULT_OPSET if opset is None else int(opset)

    # Imported here: fuser.lower.ops loads the kernels, which a plain ``import fuser.onnx`` should not.
    from fuser.lower.ops import decomposed

    with decomposed(), torch.no_grad(), _eval_mode(module):
        outputs = module(*example_inputs)
    output_tensors = _flatten(outputs)
    input_names = [f"input_{i}" for i in range(len(example_inputs))]
    output_names = [f"output_{i}" for i in range(len(output_tensors))]
    dynamic_axes = {
        name: {0: BATCH_AXIS_NAME}
        for name, t in zip(input_names + output_names, [*example_inputs, *output_tensors], strict=True)
        if t.dim() >= 1
    }

    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            with decomposed(), warnings.catch_warnings():
                # The TorchScript exporter is chosen on purpose (it needs no onnxscript and runs on every
                # torch we support); its deprecation notices would only confuse the caller.
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                torch.onnx.export(
                    module,
                    example_inputs,
                    str(tmp),
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                    opset_version=opset,
                    do_constant_folding=True,
                    dynamo=False,
                )
        except Exception as e:
            what = f"exporting {type(module).__name__} to {path} at opset {opset}"
            raise OnnxExportError(f"{what} failed: {type(e).__name__}: {e}") from e
        try:
            onnx.checker.check_model(str(tmp))
        except onnx.checker.ValidationError as e:
            raise OnnxExportError(f"the ONNX file exported for {path} fails onnx.checker: {e}") from e
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode for the duration, then each submodule's own mode back (a training BN would update its
    statistics on the example inputs)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _flatten(outputs: Any) -> list[torch.Tensor]:
    """The output tensors in the order torch.onnx names them (nested tuples, lists and dicts flattened)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _flatten(o)]
    if isinstance(outputs, dict):
        return [t for o in outputs.values() for t in _flatten(o)]
    raise TypeError(f"export_onnx: the module returned a {type(outputs).__name__}, not tensors")
