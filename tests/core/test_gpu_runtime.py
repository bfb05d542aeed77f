"""On a CUDA GPU: torch.compile over an optimized model compiles one frame (also with mode="reduce-overhead"),
CUDA graphs are on by default and fall back with one warning where a forward cannot be recorded, and an
optimized model moves between devices and through torch.save / torch.load with its packed weights rebuilt
where it lands. Run with ``pytest -m gpu tests/core/test_gpu_runtime.py``."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch._dynamo
from accuracy import assert_close, reference64
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from toy_models import ConvBnActAdd, seeded

import fuser
from fuser import models
from fuser.lower.fused_modules import FusedConv2d, FusedLinear

pytestmark = pytest.mark.gpu

CHEAP = {"calibration_batch": 2, "calibration_size": 32}
CASES = {
    "yolov8n": ({**CHEAP}, (640, 640)),
    "resnet50": ({**CHEAP}, (224, 224)),
    "efficientnet_b0": ({**CHEAP}, (224, 224)),
    "vit_tiny": ({}, (224, 224)),
}


def fused(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, (FusedConv2d, FusedLinear))]


@pytest.mark.parametrize(
    ("name", "backend"), [(name, "eager") for name in CASES] + [("yolov8n", "inductor"), ("resnet50", "inductor")]
)
def test_compiled_optimized_model_is_one_frame(name, backend):
    kwargs, size = CASES[name]
    model = models.build(name, **kwargs).cuda()
    x = models.example_input(name, batch=1, size=size, seed=1).cuda()
    opt = fuser.optimize(model, (x,))
    with torch.no_grad():
        eager = opt(x)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(opt, backend=counter)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert_close(out, eager, "tf32", f"{name} compiled ({backend}) vs eager")


def test_reduce_overhead_compiles_once():
    kwargs, size = CASES["yolov8n"]
    model = models.build("yolov8n", **kwargs).cuda()
    x = models.example_input("yolov8n", batch=1, size=size, seed=1).cuda()
    opt = fuser.optimize(model, (x,))
    with torch.no_grad():
        eager = opt(x)
    recorded = len(opt.replay._recorded)  # fuser's own graph, recorded by optimize() and the call above
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(opt, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            out = compiled(x).clone()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    assert_close(out, eager, "tf32")
    assert len(opt.replay._recorded) == recorded  # the compiler recorded its own graphs; fuser stayed out


def test_cuda_graphs_are_on_by_default_and_results_stay():
    model = seeded(nn.Sequential(ConvBnActAdd(5), ConvBnActAdd(5))).cuda()
    x1, x2 = torch.randn(2, 5, 21, 19, device="cuda"), torch.randn(2, 5, 21, 19, device="cuda")
    opt = fuser.optimize(model, (x1,))
    plain = fuser.optimize(model, (x1,), cuda_graphs=False)
    with torch.no_grad():
        y1 = opt(x1)
        y2 = opt(x2)
        assert len(opt.replay._recorded) == 1
        assert torch.equal(y1, plain(x1)) and torch.equal(y2, plain(x2))
    assert_close(y1, reference64(model.cpu(), x1.cpu()), "tf32")


class CopiesFromPageableMemory(nn.Module):
    """Adds a CPU tensor inside its forward, as transformers' BertModel does with its position ids: fine
    eagerly, not allowed during CUDA-graph capture."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnActAdd(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + torch.arange(x.shape[-1], dtype=x.dtype).to(x.device)


def test_a_forward_that_cannot_be_captured_warns_once_and_runs():
    model = seeded(CopiesFromPageableMemory()).cuda()
    x = torch.randn(2, 5, 9, 7, device="cuda")
    with torch.no_grad():
        expected = model(x)
        with pytest.warns(RuntimeWarning, match="cannot be recorded as a CUDA graph"):
            opt = fuser.optimize(model, (x,))  # the first no_grad call on CUDA inputs tries to record
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = opt(x)
    assert opt.replay.failure is not None
    assert_close(out, expected, "tf32")


def test_moves_and_save_load_rebuild_per_device():
    model = seeded(nn.Sequential(ConvBnActAdd(5), ConvBnActAdd(5)))
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,))  # CPU, backend "auto": the reference, nothing packed
    assert all(m.packed is None for m in fused(opt))
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    for device in devices:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False).to(device)
        assert all(m.packed is not None and m.packed.device == torch.device(device) for m in fused(loaded))
        xd = x.to(device)
        with torch.no_grad():
            first, again = loaded(xd), loaded(xd)  # recorded, then replayed, on this device
        assert first.device == torch.device(device) and torch.equal(first, again)
        assert_close(first.cpu(), reference64(model, x), "tf32", device)
    moved = opt.to(devices[0])
    with torch.no_grad():
        moved(x.to(devices[0]))
        back = moved.to("cpu")
        assert all(m.packed is None for m in fused(back))
        assert_close(back(x), reference64(model, x), "tf32")
