"""CUDA graphs (on by default): the forward recorded once per input signature and replayed, with the same
results; outputs a later call cannot overwrite; a bounded cache; a forward that cannot be recorded runs
plainly after one warning; a graph recorded on one device never replayed on another.

On the CPU the recording goes through :class:`StubCapture`, which behaves as a CUDA graph does where it
matters here: a replay writes the recorded output buffers in place (so returning them would let a later call
overwrite an earlier result), and a graph replays the tensors it was recorded with."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from torch.utils._pytree import tree_flatten
from toy_models import ConvBnActAdd, Untraceable, seeded

import fuser
from fuser.runtime import cuda_graphs
from fuser.runtime.cuda_graphs import MAX_GRAPHS, GraphReplay


class StubGraph:
    """A recorded call: replay runs the forward again and writes its results into the recorded outputs."""

    def __init__(self, forward, outputs: Any, device: torch.device, log: list) -> None:
        self.forward, self.outputs, self.device, self.log = forward, outputs, device, log

    def replay(self) -> None:
        self.log.append(self.device)
        for static, new in zip(tree_flatten(self.outputs)[0], tree_flatten(self.forward())[0], strict=True):
            static.copy_(new)


class StubCapture:
    """Records calls on the CPU (and the meta device); ``fail`` makes every recording raise it."""

    def __init__(self, fail: Exception | None = None, devices: tuple[str, ...] = ("cpu", "meta")) -> None:
        self.fail, self.devices = fail, devices
        self.records: list[torch.device] = []
        self.replays: list[torch.device] = []
        self.warmups = 0

    def accepts(self, inputs: tuple) -> bool:
        return bool(inputs) and all(isinstance(t, torch.Tensor) and t.device.type in self.devices for t in inputs)

    def warm_up(self, forward, device: torch.device, runs: int) -> None:
        for _ in range(runs):
            self.warmups += 1
            forward()

    def record(self, forward, device: torch.device):
        if self.fail is not None:
            raise self.fail
        self.records.append(device)
        outputs = forward()
        return StubGraph(forward, outputs, device, self.replays), outputs


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x * 2.0, {"sum": x.sum(dim=-1)}


def test_replays_return_results_a_later_call_cannot_overwrite():
    stub = StubCapture()
    replay = GraphReplay(Doubler(), capture=stub)
    x1, x2 = torch.randn(3, 5), torch.randn(3, 5)
    with torch.no_grad():
        y1, extra1 = replay(x1)
        y2, extra2 = replay(x2)
    assert len(stub.records) == 1 and len(stub.replays) == 2, "both calls must be replays of one recording"
    assert torch.equal(y1, x1 * 2.0) and torch.equal(extra1["sum"], x1.sum(dim=-1))
    assert torch.equal(y2, x2 * 2.0) and torch.equal(extra2["sum"], x2.sum(dim=-1))


def test_one_recording_per_signature_and_at_most_max_graphs():
    stub = StubCapture()
    replay = GraphReplay(Doubler(), capture=stub, warmup=1)
    shapes = [(2, 3 + i) for i in range(MAX_GRAPHS + 2)]
    with torch.no_grad():
        for shape in shapes + shapes[-MAX_GRAPHS:]:
            x = torch.randn(shape)
            assert torch.equal(replay(x)[0], x * 2.0)
    assert len(stub.records) == len(shapes)  # the second round replays the kept graphs
    assert len(replay._recorded) == MAX_GRAPHS
    assert stub.warmups == len(shapes)


def test_shapes_that_keep_changing_stop_being_recorded():
    stub = StubCapture()
    replay = GraphReplay(Doubler(), capture=stub, warmup=0)
    kept = [(1, 3 + i) for i in range(MAX_GRAPHS)]
    with torch.no_grad():
        for shape in [(2, 3 + i) for i in range(MAX_GRAPHS)] + kept + [(3, 3 + i) for i in range(MAX_GRAPHS)]:
            x = torch.randn(shape)
            assert torch.equal(replay(x)[0], x * 2.0)
        assert len(stub.records) == 2 * MAX_GRAPHS  # the third round ran plainly
        replays = len(stub.replays)
        for shape in kept:  # the most recent recordings still replay
            replay(torch.randn(shape))
    assert len(stub.replays) == replays + MAX_GRAPHS


def test_grad_mode_and_unaccepted_inputs_run_the_module():
    stub = StubCapture(devices=("meta",))
    replay = GraphReplay(Doubler(), capture=stub)
    x = torch.randn(3, 5)
    with torch.no_grad():
        assert torch.equal(replay(x)[0], x * 2.0)  # CPU inputs: not accepted by this capture
    assert torch.equal(GraphReplay(Doubler(), capture=StubCapture())(x)[0], x * 2.0)  # grad mode on
    assert not stub.records


def test_a_forward_that_cannot_be_recorded_runs_plainly_after_one_warning():
    reason = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"
    stub = StubCapture(fail=RuntimeError(reason))
    replay = GraphReplay(Doubler(), capture=stub)
    x = torch.randn(3, 5)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cannot be recorded as a CUDA graph.*pinned"):
        assert torch.equal(replay(x)[0], x * 2.0)
    assert replay.failure is not None and "pinned" in replay.failure
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second attempt
        for shape in ((3, 5), (4, 6)):
            x = torch.randn(shape)
            assert torch.equal(replay(x)[0], x * 2.0)
    assert stub.warmups == 2  # warmed up once, before the one failed recording


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the model's own error")


def test_the_forwards_own_error_is_raised_as_without_graphs():
    replay = GraphReplay(Fails(), capture=StubCapture())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="the model's own error"):
            replay(torch.randn(2, 3))
    assert replay.failure is None


def test_a_graph_is_replayed_only_on_the_device_it_was_recorded_on():
    stub = StubCapture()
    replay = GraphReplay(Doubler(), capture=stub, warmup=0)
    with torch.no_grad():
        for device in ("cpu", "meta", "cpu", "meta"):
            out = replay(torch.ones(2, 3, device=device))[0]
            assert out.device.type == device
    assert [d.type for d in stub.records] == ["cpu", "meta"]
    assert [d.type for d in stub.replays] == ["cpu", "meta", "cpu", "meta"]


def optimized_with_stub(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> tuple[fuser.OptimizedModule, StubCapture]:
    opt = fuser.optimize(model, (x,), **kwargs)
    assert opt.replay is not None, "cuda_graphs is on by default"
    stub = opt.replay.capture = StubCapture()
    return opt, stub


def test_optimized_model_replays_by_default_and_not_when_switched_off():
    model = seeded(ConvBnActAdd(5))
    x1, x2 = torch.randn(2, 5, 9, 7), torch.randn(2, 5, 9, 7)
    opt, stub = optimized_with_stub(model, x1, backend="interpret")
    with torch.no_grad():
        y1 = opt(x1)
        y2 = opt(x2)
    assert len(stub.records) == 1 and len(stub.replays) == 2
    assert_close(y1, reference64(model, x1), "tf32")
    assert_close(y2, reference64(model, x2), "tf32")
    assert fuser.optimize(model, (x1,), backend="torch", cuda_graphs=False).replay is None


def test_moving_the_model_drops_its_graphs():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7)
    opt, stub = optimized_with_stub(model, x, backend="torch")
    state = {name: t.clone() for name, t in opt.state_dict().items()}
    with torch.no_grad():
        expected = opt(x)
        opt.to("meta")
        assert not opt.replay._recorded
        assert opt(x.to("meta")).device.type == "meta"
        opt.to_empty(device="cpu")
        opt.load_state_dict(state)
        assert_close(opt(x), expected, "ieee")
    # the CPU graph recorded first replays tensors that no longer exist: recorded again, never replayed
    assert [d.type for d in stub.records] == ["cpu", "meta", "cpu"]


def test_compiled_models_leave_graphs_to_the_compiler():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7)
    opt, stub = optimized_with_stub(model, x, backend="torch")
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(opt, backend="eager")(x)
    assert not stub.records
    assert_close(out, reference64(model, x), "tf32")


def test_the_cuda_capture_accepts_only_cuda_tensors_of_one_device():
    capture = cuda_graphs.CudaCapture()
    assert not capture.accepts((torch.randn(2),))
    assert not capture.accepts(())
    assert not capture.accepts((torch.randn(2, device="meta"),))


class BranchesOnWidth(Untraceable):
    """Untraceable without example inputs (its forward branches on its input's width) yet recordable as a CUDA
    graph: Untraceable's NaN check reads a value back from the GPU, which ends a recording."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] < 3:
            raise ValueError("an image narrower than the stem's filter")
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.gpu
def test_replayed_graph_matches_and_outputs_are_not_overwritten():
    model = seeded(BranchesOnWidth()).cuda()
    opt = fuser.optimize(model, backend="triton")  # cuda_graphs on by default
    assert [u.type_name for u in opt.fusion_report.untraced] == ["BranchesOnWidth"]
    plain = fuser.optimize(model, backend="triton", cuda_graphs=False)
    with torch.no_grad():
        x1, x2 = torch.randn(2, 3, 21, 19, device="cuda"), torch.randn(2, 3, 21, 19, device="cuda")
        y1 = opt(x1)
        y2 = opt(x2)  # a replay: must not overwrite y1
        assert len(opt.replay._recorded) == 1
        assert torch.equal(y1, plain(x1)) and torch.equal(y2, plain(x2))
        x3 = torch.randn(1, 3, 33, 17, device="cuda")  # another signature: another recording
        assert torch.equal(opt(x3), plain(x3))
        assert len(opt.replay._recorded) == 2
    # with autograd on, the module runs normally (a replay records no history)
    assert torch.equal(opt(x1).detach(), y1)


@pytest.mark.gpu
def test_a_failed_recording_leaves_the_random_generator_as_it_was():
    model = seeded(Untraceable()).cuda()  # its NaN check reads a value back from the GPU: no recording
    opt = fuser.optimize(model, backend="triton")
    x = torch.randn(2, 3, 21, 19, device="cuda")
    state = torch.cuda.get_rng_state()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cannot be recorded as a CUDA graph"):
        out = opt(x)
    assert opt.replay.failure is not None
    assert torch.equal(torch.cuda.get_rng_state(), state)  # same seed and offset, and usable:
    torch.cuda.manual_seed(11)
    drawn = torch.randn(7, device="cuda")
    torch.cuda.manual_seed(11)
    assert torch.equal(torch.randn(7, device="cuda"), drawn)
    assert_close(out, reference64(model, x), "tf32", "run plainly")


def test_hooks_run_on_every_call_while_they_are_registered():
    model = seeded(Untraceable())
    x = torch.randn(1, 3, 21, 19)
    opt, stub = optimized_with_stub(model, x, backend="torch")
    fused = next(m for m in opt.modules() if isinstance(m, fuser.lower.fused_modules.FusedConv2d))
    seen = []
    with torch.no_grad():
        opt(x)
        opt(x)
        assert len(stub.replays) == 2
        handle = fused.register_forward_hook(lambda module, args, out: seen.append(out))
        opt(x)
        opt(x)
        assert len(seen) == 2 and len(stub.replays) == 2  # the hook ran both times: no replay
        handle.remove()
        opt(x)
        assert len(seen) == 2 and len(stub.replays) == 3


def test_a_model_with_hooks_before_its_first_call_is_not_recorded():
    model = seeded(Untraceable())
    x = torch.randn(1, 3, 21, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    stub = opt.replay.capture = StubCapture()
    calls = []
    opt.module.stem.register_forward_pre_hook(lambda module, args: calls.append(1))  # not a fused module
    with torch.no_grad():
        opt(x)
        opt(x)
    assert calls == [1, 1] and not stub.records
