"""torch.compile composes with fuser: ``torch.compile(fuser.optimize(m))`` compiles one frame per input
shape, with no graph break and no recompile caused by the fused modules, and computes what the optimized
module computes eagerly. Under Inductor the fused ops stay opaque custom ops (their fake implementations give
the shapes) and Inductor generates code for what lies around them.

Dynamo is run with its counting backends (``CompileCounterWithBackend``): "eager" runs the captured graph
as it is (the fused ops on the backend under test), "inductor" generates code for it."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from accuracy import assert_close, reference64
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from toy_models import ConvBnActAdd, LinearAct, seeded

import fuser
from fuser import models
from fuser.lower.fused_modules import FusedConv2d, FusedLinear

CHEAP = {"calibration_batch": 2, "calibration_size": 32}
# (model name, build options, input size): the bundled models, small; all fuse what the model has.
MODELS = {
    "yolov8n": ({**CHEAP}, (64, 32)),
    "resnet26": ({**CHEAP, "layers": (1, 1, 1, 1), "width": 8}, (35, 33)),
    "efficientnet_b0": ({**CHEAP, "width_mult": 0.25}, (37, 35)),
    "vit_tiny": ({"img_size": (35, 33), "depth": 2}, (35, 33)),
    "bert_tiny": ({"depth": 1}, 13),
}
# The interpreter runs every kernel launch in Python: only the models whose forward it runs in seconds.
INTERPRETED = ["resnet26", "vit_tiny", "bert_tiny"]


def compile_and_count(module: nn.Module, *inputs: torch.Tensor, backend: str = "eager", calls: int = 3):
    """(outputs of the last compiled call, dynamo's frame count, graph breaks) for ``calls`` calls."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter)
    with torch.no_grad():
        for _ in range(calls):
            out = compiled(*inputs)
    return out, counter, dict(counters["graph_break"])


def fused_count(module: nn.Module) -> int:
    return sum(isinstance(m, (FusedConv2d, FusedLinear)) for m in module.modules())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend"),
    [(name, "torch") for name in MODELS] + [(name, "interpret") for name in INTERPRETED],
)
def test_bundled_model_compiles_to_one_frame(name, backend):
    kwargs, size = MODELS[name]
    model = models.build(name, **kwargs)
    x = models.example_input(name, batch=2, size=size, seed=1)
    opt = fuser.optimize(model, (x,), backend=backend)
    assert fused_count(opt) == model.expected_fusions
    with torch.no_grad():
        eager = opt(x)  # also fills the model's own shape-keyed caches (YOLO's anchors) before compiling
    out, counter, breaks = compile_and_count(opt, x)
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} frames compiled (a recompile or a break)"
    assert not breaks, f"{name}: graph breaks {breaks}"
    fused_ops = [
        n for g in counter.graphs for n in g.graph.nodes if str(n.target).startswith("fuser.")
    ]  # each fused module is one custom-op node of the one graph
    assert len(fused_ops) == model.expected_fusions
    assert_close(out, eager, "ieee", f"{name} compiled vs eager on {backend}")


def test_a_second_shape_compiles_once_more_and_no_more():
    model = nn.Sequential(seeded(ConvBnActAdd(5)), seeded(ConvBnActAdd(5), seed=2))
    x, y = torch.randn(2, 5, 9, 7), torch.randn(1, 5, 13, 11)
    opt = fuser.optimize(model, (x,), backend="interpret")
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(opt, backend=counter, dynamic=False)
    with torch.no_grad():
        for inputs in (x, y, x, y, x):
            out = compiled(inputs)
    assert counter.frame_count == 2
    assert not counters["graph_break"]
    assert_close(out, reference64(model, x), "tf32")


def test_explain_finds_one_graph_and_no_break():
    model = seeded(LinearAct(act=nn.GELU(), residual=True, scale=0.7))
    x, r = torch.randn(2, 7, 19), torch.randn(2, 7, 21)
    opt = fuser.optimize(model, (x, r), backend="interpret")
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(opt)(x, r)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


class ConvThenElementwise(nn.Module):
    """Fused chains (two convs, a linear over the last dim) with unfused elementwise work between and after
    them, for Inductor to generate."""

    def __init__(self) -> None:
        super().__init__()
        self.a = ConvBnActAdd(5)
        self.b = ConvBnActAdd(5)
        self.fc = nn.Linear(9, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = torch.tanh(y * 0.5 + 0.25)
        y = self.b(y).sigmoid() * 2.0 - 1.0
        return torch.relu(self.fc(y)) + y.mean(dim=-1, keepdim=True)


@pytest.mark.slow
def test_inductor_keeps_the_fused_ops_opaque_and_generates_the_rest():
    from torch._inductor.utils import run_and_get_code

    model = seeded(ConvThenElementwise())
    x = torch.randn(2, 5, 11, 9)
    opt = fuser.optimize(model, (x,), backend="interpret")
    assert fused_count(opt) == 3
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(opt, backend=counter)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
        again = compiled(x)
    assert counter.frame_count == 1 and not counters["graph_break"]
    code = "\n".join(codes)
    assert code.count("torch.ops.fuser.conv2d_act.default(") == 2, code
    assert code.count("torch.ops.fuser.gemm_act.default(") == 1, code
    assert "cpp_fused" in code, code  # the elementwise remainder became generated kernels
    ref = reference64(model, x)
    assert_close(out, ref, "tf32")
    assert_close(again, ref, "tf32")
