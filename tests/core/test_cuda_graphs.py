"""cuda_graphs=True: the forward recorded once per input signature and replayed, with the same results."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close
from toy_models import ConvBnActAdd, Untraceable, seeded

import fuser


def test_cuda_graphs_flag_is_harmless_on_cpu_inputs():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,), backend="torch", cuda_graphs=True)
    with torch.no_grad():
        assert_close(opt(x), model(x), "ieee")
    assert opt.replay is not None and not opt.replay._recorded


@pytest.mark.gpu
def test_replayed_graph_matches_and_outputs_are_not_overwritten():
    model = seeded(Untraceable()).cuda()
    opt = fuser.optimize(model, backend="triton", cuda_graphs=True)
    plain = fuser.optimize(model, backend="triton")
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
