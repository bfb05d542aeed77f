"""An optimized model saved once loads and moves to any device: everything derived from its weights (the
packed copies the kernels read, the per-signature calls, the recorded graphs) belongs to one device and is
derived again there, never carried over. On the CPU the devices are "cpu" and "meta"; the CUDA graphs part
is in test_cuda_graphs.py."""

from __future__ import annotations

import io

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnActAdd, LinearAct, seeded

import fuser
from fuser.lower import kernel_dispatch
from fuser.lower.fused_modules import FusedConv2d, FusedLinear


def fused_modules(module: nn.Module) -> list[FusedConv2d | FusedLinear]:
    return [m for m in module.modules() if isinstance(m, (FusedConv2d, FusedLinear))]


class ConvAndLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnActAdd(5)
        self.head = LinearAct(k=7, n=11, act=nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def expected_packed(module: FusedConv2d | FusedLinear) -> torch.Tensor:
    gain = module.tf32_input_gain  # the truncation compensation fuser.rewrite.tf32_rounding chose
    if isinstance(module, FusedConv2d):
        return kernel_dispatch.pack_conv(module.weight, module.groups, module.kernel_precision, gain)
    return kernel_dispatch.pack_gemm(module.weight, module.kernel_precision, gain)


@pytest.fixture
def optimized():
    model = seeded(ConvAndLinear())
    x = torch.randn(2, 5, 9, 7)
    return model, x, fuser.optimize(model, (x,), backend="interpret")


def test_packed_weights_are_built_with_the_module_and_not_saved(optimized):
    model, x, opt = optimized
    for m in fused_modules(opt):
        assert m.packed is not None and torch.equal(m.packed, expected_packed(m))
        assert m.packed.device == m.weight.device
    assert not any(name.endswith("packed") for name in opt.state_dict())
    assert not any(name.endswith("packed") for name in fuser.optimize(model, (x,), backend="torch").state_dict())


def test_save_and_load_round_trip_rebuilds_what_is_derived(optimized):
    model, x, opt = optimized
    with torch.no_grad():
        before = opt(x)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    saved = buffer.getbuffer().nbytes
    plain = io.BytesIO()
    torch.save(fuser.optimize(model, (x,), backend="torch"), plain)  # the same model with nothing packed
    assert saved < plain.getbuffer().nbytes * 1.1, "packed copies must not be saved"
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for m in fused_modules(loaded):
        assert torch.equal(m.packed, expected_packed(m))
        assert not m.__dict__["_calls"]
    with torch.no_grad():
        assert torch.equal(loaded(x), before)


def test_moving_between_devices_derives_everything_again(optimized):
    _, x, opt = optimized
    with torch.no_grad():
        before = opt(x)
    state = {name: t.clone() for name, t in opt.state_dict().items()}
    opt.to("meta")
    for m in fused_modules(opt):
        assert m.weight.device.type == "meta"
        assert m.packed is None  # the interpreter does not run on meta tensors: nothing to pack there
        assert not m.__dict__["_calls"]  # calls hold the tensors of the device they were built for
    opt.to_empty(device="cpu")
    opt.load_state_dict(state)
    for m in fused_modules(opt):
        assert m.packed.device.type == "cpu" and torch.equal(m.packed, expected_packed(m))
    with torch.no_grad():
        assert torch.equal(opt(x), before)


def test_the_reference_backend_runs_on_the_meta_device():
    model = seeded(ConvAndLinear())
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,), backend="auto", cuda_graphs=False).to("meta")
    with torch.no_grad():
        out = opt(x.to("meta"))
    assert out.device.type == "meta" and out.shape == (2, 5, 9, 11)


def test_a_cast_packs_again_in_the_new_dtype(optimized):
    model, x, opt = optimized
    with torch.no_grad():
        opt.double()
        for m in fused_modules(opt):
            assert m.packed is None  # float64 runs the reference: nothing packed
        assert_close(opt(x.double()), reference64(model, x), "ieee")
        opt.half()
        for m in fused_modules(opt):
            assert m.kernel_precision.value == "fp16"
            assert m.packed.dtype == torch.float16 and torch.equal(m.packed, expected_packed(m))
        assert_close(opt(x.half()).float(), reference64(model, x), "fp16")


def test_weights_written_in_place_are_packed_again_on_the_next_eager_call(optimized):
    _, x, opt = optimized
    other = seeded(ConvAndLinear(), seed=5)
    with torch.no_grad():
        opt(x)
        for mine, theirs in zip(fused_modules(opt), fused_modules(fuser.optimize(other, (x,))), strict=True):
            mine.weight.copy_(theirs.weight)  # behind the module's back: no load_state_dict
            mine.bias.copy_(theirs.bias)
        assert_close(opt(x), reference64(other, x), "tf32")
