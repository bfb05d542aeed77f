"""Data-parallel inference on the CPU (benchmarks/multi_gpu.py): two gloo processes each load one saved
optimized model and run their shard of the batches; together they give exactly what one process gives,
and that is the original model's answer within the ieee tolerance of a float64 run."""

from __future__ import annotations

import copy

import pytest
import torch
from accuracy import TOLERANCE, rel_error
from torch import nn
from toy_models import ConvBnAct, seeded

import fuser
from benchmarks import multi_gpu

BATCHES, BATCH, SIZE = 3, 2, 13  # 3 batches over 2 ranks: rank 0 runs two, rank 1 one


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, object]:
    model = seeded(ConvBnAct(nn.SiLU(), c_in=3, c_out=7))
    example = multi_gpu.batch_input(0, BATCH, SIZE)
    optimized = fuser.optimize(model, (example,), precision="ieee", backend="torch", cuda_graphs=False)
    assert len(optimized.fusion_report.fused) == 1
    path = tmp_path_factory.mktemp("model") / "optimized.pt"
    torch.save(optimized, path)
    return model, path


def _run(path: object, procs: int) -> dict:
    return multi_gpu.run_data_parallel(
        path, device="cpu", procs=procs, batches=BATCHES, batch=BATCH, size=SIZE, threads=1, keep_outputs=True
    )


def test_two_gloo_processes_equal_one_process(saved: tuple[nn.Module, object]) -> None:
    model, path = saved
    one, two = _run(path, 1), _run(path, 2)
    assert two["backend"] == "gloo" and two["on_device"]
    assert sorted(two["outputs"]) == sorted(one["outputs"]) == list(range(BATCHES))
    for b in range(BATCHES):
        assert torch.equal(two["outputs"][b][0], one["outputs"][b][0]), f"batch {b} differs between runs"
    assert two["digests"] == one["digests"]
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        for b in range(BATCHES):
            expected = reference(multi_gpu.batch_input(b, BATCH, SIZE).double())
            assert rel_error(two["outputs"][b][0], expected) < TOLERANCE["ieee"]


def test_digest_sees_one_changed_value() -> None:
    out = (torch.randn(3, 5), {"x": torch.randn(2)})
    changed = (out[0].clone(), {"x": out[1]["x"].clone()})
    assert multi_gpu.output_digest(out) == multi_gpu.output_digest(changed)
    changed[1]["x"][1] = torch.nextafter(changed[1]["x"][1], torch.tensor(float("inf")))
    assert multi_gpu.output_digest(out) != multi_gpu.output_digest(changed)
