"""What the export and compile tests share: an exported file run in onnxruntime (one thread, CPU), a module
compiled by torch.compile with dynamo's counters, and the warnings torch.onnx's exporters print on real models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

# What torch.onnx's two exporters warn about on real libraries' models (deprecations, tracer notes on Python
# control flow, version advice): not findings of the tests that export them.
EXPORTER_WARNINGS = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


def exported_standard(path: str | Path) -> onnx.ModelProto:
    """The exported model, checked, after asserting that it uses standard ONNX ops only (no custom domain)."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    custom = {n.domain for n in model.graph.node if n.domain and n.domain != "ai.onnx"}
    assert not custom, f"non-standard ONNX domains in the export: {custom}"
    return model


def run_onnxruntime(path: str | Path, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of the ONNX file at ``path`` for ``inputs`` (fed in the graph's input order)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = {name: t.numpy() for name, t in zip(names, inputs, strict=True)}
    return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds)]


def compile_once(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``torch.compile(module)(x)`` (eager backend), called twice, after asserting one frame and no graph break."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(module, backend=counter)
    with torch.no_grad():
        compiled(x)
        out = compiled(x)
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    return out


def onnx_matches_float64(
    fast: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor, other: torch.Tensor, path: Path
) -> list[str]:
    """Export ``fast`` (traced on ``x``) to ``path``, assert it is standard ONNX and that onnxruntime's output
    for ``other`` (another batch size: the batch axis is dynamic) matches ``model`` in float64; returns the
    exported op types."""
    from accuracy import assert_close, reference64

    from fuser.onnx.exporter import export_onnx

    exported = exported_standard(export_onnx(fast, (x,), path))
    (got,) = run_onnxruntime(path, other)
    assert_close(got, reference64(model, other), "ieee", "onnxruntime")
    return [n.op_type for n in exported.graph.node]
