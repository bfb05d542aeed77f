"""The public API: optimize / explain contracts, the user's model untouched, save/load, errors, flags."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnAct, ConvBnActAdd, Untraceable, seeded

import fuser
from fuser.lower.fused_modules import FusedConv2d


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "modules": [(name, type(m), m.training) for name, m in model.named_modules()],
        "attrs": {name: dict(vars(m)) for name, m in model.named_modules()},
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} was modified"
    for name, attrs in before["attrs"].items():
        assert "forward" not in after["attrs"][name], f"{name}.forward was replaced"
        assert set(attrs) == set(after["attrs"][name]), f"{name}'s attributes changed"


def test_users_model_and_parameters_are_not_modified():
    model = seeded(Untraceable())
    before = snapshot(model)
    x = torch.randn(2, 3, 21, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    fuser.explain(model, (x,))
    assert_unchanged(model, before)
    assert model.seen_shape is None  # the example run happened on a copy
    # the optimized model does not share tensors with the user's model
    user_ptrs = {t.data_ptr() for t in model.state_dict().values()}
    assert not user_ptrs & {t.data_ptr() for t in opt.state_dict().values()}
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")


def test_inplace_optimizes_the_model_itself():
    model = seeded(Untraceable())
    x = torch.randn(2, 3, 21, 19)
    ref = reference64(model, x)
    opt = fuser.optimize(model, (x,), backend="torch", inplace=True)
    assert opt.module is model
    assert any(isinstance(m, FusedConv2d) for m in model.modules())
    with torch.no_grad():
        assert_close(opt(x), ref, "ieee")


def test_untraceable_model_is_fused_through_its_traceable_parts():
    model = seeded(Untraceable())
    x = torch.randn(1, 3, 21, 19)
    report = fuser.explain(model, (x,))
    assert [u.path for u in report.untraced] == ["(model)"]
    untraced = report.untraced[0]
    assert untraced.reason == (
        "its forward branches on a computed value (if, while, and, or); "
        "its submodules were traced and optimized one by one instead"
    )
    assert "control flow" in untraced.detail  # torch.fx's own words, for a bug report
    assert untraced.detail in str(report)
    assert len(report.fused) == 3
    assert {e.graph for e in report.fused} == {"stem", "blocks.0", "blocks.1"}
    assert report.fused[0].location == "stem.{conv,bn,act}"
    opt = fuser.optimize(model, (x,), backend="torch")
    assert type(opt.module) is Untraceable and type(opt.module.stem) is type(model.stem)
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")


class SqueezeCat(nn.Module):
    """Two conv blocks into a cat (its buffer replaces the cat), then one more: the report's rewrites."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = ConvBnAct(nn.SiLU(), 5, 7), ConvBnAct(nn.SiLU(), 5, 9), ConvBnAct(nn.ReLU(), 16, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.cat([self.a(x), self.b(x)], 1))


def test_explain_reports_what_optimize_does_after_the_chains_too():
    """explain() runs optimize()'s passes on a copy: the cat buffer is in its report, the model is unchanged."""
    model = seeded(SqueezeCat())
    x = torch.randn(2, 5, 13, 11)
    explained = fuser.explain(model, (x,), backend="torch")
    optimized = fuser.optimize(model, (x,), backend="torch").fusion_report
    assert "cat_buffer" in [r.kind for r in explained.rewrites], str(explained)
    assert explained.to_dict() == optimized.to_dict()
    assert not any(isinstance(m, FusedConv2d) for m in model.modules())


def test_explain_reports_without_rewriting():
    model = seeded(ConvBnActAdd(5))
    report = fuser.explain(model)
    assert isinstance(report, fuser.FusionReport)
    text = str(report)
    assert "1 chains fused" in text and "conv_bn_act" in text and "bias -> silu -> +residual" in text
    assert report.to_dict()["fused"][0]["activation"] == "silu"


def test_optimized_module_round_trips_through_torch_save_in_a_fresh_process(tmp_path: Path):
    model = seeded(Untraceable())
    x = torch.randn(2, 3, 21, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    torch.save(opt, tmp_path / "opt.pt")
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(opt(x), tmp_path / "expected.pt")
    code = (
        "import torch\n"
        f"m = torch.load(r'{tmp_path / 'opt.pt'}', weights_only=False)\n"
        f"x = torch.load(r'{tmp_path / 'x.pt'}')\n"
        f"expected = torch.load(r'{tmp_path / 'expected.pt'}')\n"
        "with torch.no_grad():\n"
        "    out = m(x)\n"
        "assert torch.equal(out, expected), (out - expected).abs().max()\n"
        "print(type(m).__name__, len(m.fusion_report.fused))\n"
    )
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": tests_dir, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OptimizedModule", "3"]


def test_global_torch_flags_are_restored():
    model = seeded(ConvBnAct(nn.SiLU()))
    x = torch.randn(1, 5, 7, 7)
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    for precision in ("tf32", "ieee", "bf16"):
        opt = fuser.optimize(model, (x,), backend="torch", precision=precision)
        with torch.no_grad():
            opt(x)
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_policy_rounds_operands(precision):
    model = seeded(ConvBnAct(nn.SiLU(), 19, 21))
    x = torch.randn(2, 19, 13, 11)
    opt = fuser.optimize(model, (x,), backend="torch", precision=precision)
    ref = reference64(model, x)
    with torch.no_grad():
        out = opt(x)
    assert out.dtype == torch.float32
    assert_close(out, ref, precision)
    # the rounding really happened: bf16/fp16 operands cannot reach float32 accuracy
    assert (out.double() - ref).norm() / ref.norm() > 1e-5


def test_bad_model_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"got builtins\.int"):
        fuser.optimize(3)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        fuser.explain([nn.ReLU()])


def test_missing_path_is_file_not_found():
    with pytest.raises(FileNotFoundError, match=r"no-such-model\.onnx"):
        fuser.optimize("/tmp/no-such-model.onnx")


def test_example_input_the_model_rejects():
    model = seeded(ConvBnAct(nn.SiLU(), 5, 7))
    with pytest.raises(ValueError, match=r"raised RuntimeError on the example inputs \(\(1, 3, 8, 8\) float32"):
        fuser.optimize(model, torch.randn(1, 3, 8, 8))


def test_bad_precision_and_backend_are_named():
    model = ConvBnAct(nn.SiLU())
    with pytest.raises(ValueError, match=r"unknown precision 'tf16'"):
        fuser.optimize(model, precision="tf16")
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'"):
        fuser.optimize(model, backend="cuda")


def test_triton_backend_on_cpu_input_says_what_to_use():
    model = seeded(ConvBnAct(nn.SiLU()))
    opt = fuser.optimize(model, backend="triton")
    with pytest.raises(ValueError, match=r"backend='interpret'"):
        opt(torch.randn(1, 5, 7, 7))


def test_user_model_copy_failure_is_explained():
    class Uncopyable(nn.Module):
        def __deepcopy__(self, memo):
            raise RuntimeError("holds a file handle")

    with pytest.raises(TypeError, match="inplace=True"):
        fuser.optimize(Uncopyable())


def test_a_copy_that_fails_on_fake_tensors_left_by_tracing_names_them():
    """ultralytics' Detect head caches its anchors in its forward; after torch.onnx.export(dynamo=True) they are
    fake tensors and the model cannot be copied. The error names them and says what to do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Head(nn.Module):
        def __deepcopy__(self, memo):
            raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)")

    model = nn.Sequential(nn.Conv2d(3, 5, 3), Head())
    with FakeTensorMode():
        model[1].anchors, model[1].cache = torch.ones(2, 7), [torch.ones(3)]
    with pytest.raises(TypeError, match=r"`1\.anchors`, `1\.cache\[0\]` hold fake tensors .* build or load it again"):
        fuser.optimize(model)


def test_optimizing_twice_gives_the_same_result():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 7, 7)
    a = fuser.optimize(model, (x,), backend="torch")
    b = fuser.optimize(copy.deepcopy(model), (x,), backend="torch")
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


class TryExcept(nn.Module):
    """Eager falls back to `b` when `a` rejects the input; torch.fx records only the `a` path."""

    def __init__(self) -> None:
        super().__init__()
        self.a = ConvBnAct(nn.SiLU(), 3, 4)
        self.b = ConvBnAct(nn.SiLU(), 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.a(x)
        except RuntimeError:
            return self.b(x)


def test_traced_graph_that_fails_where_eager_runs_is_left_alone():
    model = seeded(TryExcept())
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,), backend="torch")
    report = opt.fusion_report
    assert [u.path for u in report.untraced] == ["(model)"]
    assert "traced graph fails where its forward runs" in report.untraced[0].reason
    assert report.untraced[0].detail.startswith("RuntimeError")
    assert not report.fused
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")


def test_an_internal_failure_leaves_that_graph_unoptimized(monkeypatch):
    import fuser.api

    def broken(*args, **kwargs):
        raise KeyError("simulated bug")

    monkeypatch.setattr(fuser.api, "find_chains", broken)
    monkeypatch.delenv("FUSER_STRICT")
    model = seeded(Untraceable())
    x = torch.randn(1, 3, 21, 19)
    with pytest.warns(RuntimeWarning, match="simulated bug"):
        opt = fuser.optimize(model, (x,), backend="torch")
    assert not opt.fusion_report.fused
    reasons = [u.reason for u in opt.fusion_report.untraced]
    assert sum("simulated bug" in r and "please report" in r for r in reasons) == 3
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")


def test_strict_mode_raises_an_internal_failure(monkeypatch):
    import fuser.api

    def broken(*args, **kwargs):
        raise KeyError("simulated bug")

    monkeypatch.setattr(fuser.api, "find_chains", broken)
    with pytest.raises(KeyError, match="simulated bug"):
        fuser.optimize(seeded(ConvBnAct(nn.SiLU())), (torch.randn(1, 5, 9, 7),), backend="torch")


@pytest.mark.parametrize(
    ("forward", "sentence"),
    [
        (lambda self, x: [t for t in x], "loops over or unpacks a computed value"),
        (lambda self, x: x[: len(x)], "calls len() on a computed value"),
        (lambda self, x: x.new_zeros(int(x.shape[0])), "turns a computed value into a Python number"),
    ],
    ids=["iterate", "len", "int"],
)
def test_trace_failures_are_said_in_plain_words(forward, sentence):
    leaf = type("Leaf", (nn.Module,), {"forward": forward})
    report = fuser.explain(leaf())
    (entry,) = report.untraced
    assert sentence in entry.reason and entry.reason.endswith("it runs as it is")
    assert "Proxy" not in entry.reason and entry.detail


def test_partly_traced_detector_holds_no_dead_weights(tmp_path: Path):
    from fuser.models import build, example_input

    model = build("yolov8n", calibration_batch=2, calibration_size=32)
    x = example_input("yolov8n", size=64)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert opt.fusion_report.untraced and opt.fusion_report.fused  # partly traced: the head does not trace

    def numel(m: nn.Module) -> int:
        return sum(v.numel() for v in m.state_dict().values())

    assert numel(opt) <= numel(model)

    def count(m: nn.Module, kind: type) -> int:
        return sum(isinstance(sub, kind) for sub in m.modules())

    fused = opt.fusion_report.fused
    assert count(opt, nn.Conv2d) == count(model, nn.Conv2d) - len(fused), "a replaced conv is kept"
    folded = sum("batch_norm" in e.ops for e in fused)
    assert count(opt, nn.BatchNorm2d) == count(model, nn.BatchNorm2d) - folded, "a folded BN is kept"
    torch.save(model, tmp_path / "model.pt")
    torch.save(opt, tmp_path / "opt.pt")
    assert (tmp_path / "opt.pt").stat().st_size <= (tmp_path / "model.pt").stat().st_size
    with torch.no_grad():
        out, ref = opt(x), reference64(model, x)
    assert_close(out[0] if isinstance(out, tuple) else out, ref[0] if isinstance(ref, tuple) else ref, "ieee")
