"""backend="measured" on CUDA: each fused op takes the faster of its Triton kernel and the vendor library."""

from __future__ import annotations

import math

import pytest
import torch
from accuracy import assert_close, reference64
from toy_models import ConvBnActAdd, LinearAct, Untraceable, seeded

import fuser
from fuser.lower import path_choice


@pytest.fixture(autouse=True)
def _fresh_choices():
    path_choice.clear()
    yield
    path_choice.clear()


def fake_timer(monkeypatch, times: dict):
    calls = []

    def time_ms(fn):
        calls.append(fn)
        try:
            fn()
        except Exception:
            return math.inf
        return times[fn.__name__]

    monkeypatch.setattr(path_choice, "_time_ms", time_ms)
    return calls


def test_the_faster_implementation_is_chosen_once(monkeypatch):
    def kernel():
        return "k"

    def library():
        return "l"

    calls = fake_timer(monkeypatch, {"kernel": 2.0, "library": 1.0})
    assert path_choice.choose(("sig", 1), kernel, library) == path_choice.LIBRARY
    assert path_choice.choose(("sig", 1), kernel, library) == path_choice.LIBRARY
    assert len(calls) == 2  # measured on the first call only
    fake_timer(monkeypatch, {"kernel": 0.5, "library": 1.0})
    assert path_choice.choose(("sig", 2), kernel, library) == path_choice.KERNEL
    assert path_choice.choices()[("sig", 2)] == ("kernel", 0.5, 1.0)


def test_a_failing_kernel_loses(monkeypatch):
    def kernel():
        raise RuntimeError("out of shared memory")

    def library():
        return "l"

    fake_timer(monkeypatch, {"library": 5.0})
    assert path_choice.choose("sig", kernel, library) == path_choice.LIBRARY


def test_nothing_is_measured_while_a_cuda_graph_records(monkeypatch):
    calls = fake_timer(monkeypatch, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert path_choice.choose("sig", lambda: 1, lambda: 2) == path_choice.KERNEL
    assert not calls and not path_choice.choices()


def test_signature_tells_shapes_strides_and_dtypes_apart():
    x = torch.randn(2, 3, 5, 7)
    assert path_choice.signature(x) == path_choice.signature(x.clone())
    assert path_choice.signature(x) != path_choice.signature(x.contiguous(memory_format=torch.channels_last))
    assert path_choice.signature(x) != path_choice.signature(x.half())
    assert path_choice.signature(x, None, extra=(1,)) != path_choice.signature(x, None, extra=(2,))


@pytest.mark.gpu
def test_measured_backend_on_cuda_measures_and_stays_correct():
    for make, inputs in [
        (lambda: Untraceable(), (torch.randn(2, 3, 21, 19),)),
        (lambda: ConvBnActAdd(19), (torch.randn(1, 19, 33, 31),)),
        (lambda: LinearAct(act=torch.relu, residual=True, scale=0.5), (torch.randn(7, 19), torch.randn(7, 21))),
    ]:
        model = seeded(make())
        expected = reference64(model, *inputs)
        opt = fuser.optimize(model.cuda(), tuple(t.cuda() for t in inputs), backend="measured")
        with torch.no_grad():
            assert_close(opt(*(t.cuda() for t in inputs)), expected, "tf32")
    made = path_choice.choices()
    assert made and {c for c, _, _ in made.values()} <= {path_choice.KERNEL, path_choice.LIBRARY}
    assert all(math.isfinite(min(k, lib)) for _, k, lib in made.values())


def test_measured_backend_needs_cuda_inputs():
    model = seeded(LinearAct(act=torch.relu))
    with pytest.raises(ValueError, match="backend='measured' runs compiled kernels on CUDA tensors"):
        fuser.optimize(model, (torch.randn(3, 19),), backend="measured")
