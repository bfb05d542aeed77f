"""Capture of models that do not trace as a whole: a failing submodule becomes a leaf, splits can be iterated.

The routed model copies the structure of ultralytics' DetectionModel: a forward that routes the outputs of
``self.layers`` by each layer's ``f`` (traceable Python), blocks that iterate ``list(x.chunk(2, 1))`` as
ultralytics' C2f does, a neck that upsamples and concatenates across blocks, and a head that branches on a
shape (untraceable in its own code). Everything but the head must be one graph, so that the rewrites that
span blocks (the neck's virtual concatenation, cat buffers) see it.

Also: a module its parent calls with keyword arguments that its traced graph does not take (transformers'
layers get ``position_ids``) is captured through its children, and a traced model returning a dict class
(transformers' ModelOutput, an OrderedDict) returns that class, also after save and load.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnAct, seeded

import fuser
from fuser.capture.tracing import capture, split_count, trace, trace_around_failures


class ChunkBlock(nn.Module):
    """ultralytics' C2f: conv, ``list(chunk(2, 1))``, a residual conv on the last piece, cat, conv."""

    def __init__(self, c_in: int, c: int, c_out: int) -> None:
        super().__init__()
        self.cv1 = ConvBnAct(nn.SiLU(), c_in, 2 * c, kernel_size=1, padding=0)
        self.m = nn.ModuleList([ConvBnAct(nn.SiLU(), c, c)])
        self.cv2 = ConvBnAct(nn.SiLU(), 3 * c, c_out, kernel_size=1, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(y[-1] + m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class Cat(nn.Module):
    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, 1)


class ShapeHead(nn.Module):
    """Remembers the input shape it last saw (untraceable: it compares shapes), around a traceable conv."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = ConvBnAct(nn.ReLU(), c, 5)
        self.shape: torch.Size | None = None

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        if self.shape != x[0].shape:
            self.shape = x[0].shape
        return self.conv(x[0]).mean((2, 3)) + x[1].mean((2, 3))[:, :5]


def _layer(module: nn.Module, f: int | list[int]) -> nn.Module:
    module.f = f
    return module


class Routed(nn.Module):
    """``forward(x, *args, **kwargs)`` routing ``self.layers`` by ``m.f`` and keeping the outputs ``save``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            _layer(ConvBnAct(nn.SiLU(), 3, 16, stride=2), -1),  # 0
            _layer(ChunkBlock(16, 5, 16), -1),  # 1
            _layer(ConvBnAct(nn.SiLU(), 16, 16, stride=2), -1),  # 2
            _layer(nn.Upsample(scale_factor=2, mode="nearest"), -1),  # 3
            _layer(Cat(), [-1, 1]),  # 4: cat(upsample(2), 1)
            _layer(ChunkBlock(32, 7, 13), -1),  # 5
            _layer(ShapeHead(13), [5, 2]),  # 6
        )
        self.save = {1, 2, 5}

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        y: list[torch.Tensor | None] = []
        for i, m in enumerate(self.layers):
            if m.f != -1:
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if i in self.save else None)
        return x


def test_a_failing_submodule_becomes_a_leaf_and_the_rest_is_one_graph():
    captured = capture(seeded(Routed()))
    assert [g.path for g in captured.graphs] == ["", "layers.6.conv"]
    assert [(u.path, u.type_name) for u in captured.untraced] == [("layers.6", "ShapeHead")]
    assert "branches on a computed value" in captured.untraced[0].reason
    root = captured.graphs[0].gm
    leaves = [n.target for n in root.graph.nodes if n.op == "call_module" and n.target.startswith("layers.6")]
    assert leaves == ["layers.6"], "the head is called as one module"
    assert sum(n.target is torch.cat for n in root.graph.nodes) == 3, "both blocks' cats and the neck's"


def test_routed_model_is_optimized_across_its_blocks():
    model = seeded(Routed())
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 20, 28)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    report = fast.fusion_report
    kinds = [(r.kind, r.location) for r in report.rewrites]
    assert ("virtual_cat", "layers.4") in kinds, str(report)
    assert ("cat_buffer", "layers.1") in kinds and ("cat_buffer", "layers.5") in kinds, str(report)
    assert len(report.fused) == 9, str(report)  # every conv -> BN -> act, the head's included
    with torch.no_grad():
        first = fast(x)
        kept = first.clone()
        second = fast(torch.randn_like(x))
    assert torch.equal(first, kept), "a later call overwrote the result of an earlier one"
    assert not torch.equal(first, second)
    assert_close(first, reference64(model, x), "ieee", "routed")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the user's model changed"
    assert model.layers[6].shape is None, "the example run happened on a copy"


class Splits(nn.Module):
    """Iterates a chunk, a split by sizes and a tensor_split, as plain torch.fx cannot."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = sum(list(x.chunk(3, 1)))
        b = torch.stack([*torch.split(x, [2, 4], dim=1)][::-1][0].unbind(0))
        c = [t.relu() for t in x.tensor_split(2, dim=2)]
        return a.sum() + b.sum() + torch.cat(c, 2).sum() * len(c)


def test_splits_of_known_count_can_be_iterated():
    gm = trace(Splits())
    counts = sorted(split_count(n) for n in gm.graph.nodes if split_count(n) is not None)
    assert counts == [2, 2, 3]
    x = torch.randn(3, 6, 5, 7)
    assert torch.allclose(gm(x), Splits()(x))
    assert not fuser.explain(Splits(), (x,)).untraced


class ShortChunk(nn.Module):
    """chunk(4) along a dimension of 3: torch returns 3 pieces, the trace takes 4."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(F.silu(x).chunk(4, 2)), 3) + self.block(x).sum()


def test_a_chunk_with_fewer_pieces_than_traced_leaves_the_graph_unoptimized():
    model = seeded(ShortChunk())
    x = torch.randn(2, 3, 3, 5)
    fast = fuser.optimize(model, (x,), backend="torch")
    (entry,) = fast.fusion_report.untraced
    assert entry.path == "(model)" and "traced graph fails where its forward runs" in entry.reason
    assert "returned 3 pieces, the trace took 4" in entry.detail
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", "short chunk")


def test_forward_with_varargs_is_traced_as_called_with_its_named_parameters():
    gm, leaves = trace_around_failures(Routed())
    assert [name for name, _ in leaves] == ["layers.6"]
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]


@pytest.mark.parametrize("leaf_limit", [0, 1])
def test_too_many_failing_submodules_fall_back_to_the_children(monkeypatch, leaf_limit):
    import fuser.capture.tracing as tracing

    monkeypatch.setattr(tracing, "MAX_LEAVES", leaf_limit)
    captured = capture(seeded(Routed()))
    paths = [g.path for g in captured.graphs]
    if leaf_limit == 0:
        assert "" not in paths and "layers.1" in paths, paths
        assert captured.untraced[0].path == "(model)"
    else:
        assert paths == ["", "layers.6.conv"]


class IteratesItsLayers(nn.Module):
    """Iterates ``self.layers`` (never calls it) and checks a value (untraceable in its own code); the
    Sequential itself traces, with the head as a leaf, into a graph that nothing runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(ConvBnAct(nn.SiLU(), 3, 8), ConvBnAct(nn.SiLU(), 8, 8), _Pair(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x
        for i, m in enumerate(self.layers):
            x = m([x, skip]) if i == 2 else m(x)
        return x if bool(x.isfinite().all()) else x.nan_to_num()


class _Pair(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = ConvBnAct(nn.ReLU(), c, c)

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        if x[0].shape[1] != 8:  # untraceable
            raise ValueError("8 channels")
        return self.conv(x[0]) + x[1].mean()


def test_a_module_whose_forward_never_runs_is_replaced_by_its_children():
    model = seeded(IteratesItsLayers())
    x = torch.randn(2, 3, 9, 7)
    fast = fuser.optimize(model, (x,), backend="torch")
    report = fast.fusion_report
    entries = {u.path: u.reason for u in report.untraced}
    assert "forward does not run when the model runs" in entries["layers"], entries
    assert sorted(e.graph for e in report.fused) == ["layers.0", "layers.1", "layers.2.conv"], str(report)
    assert [type(m).__name__ for m in fast.module.layers] == ["ConvBnAct", "ConvBnAct", "_Pair"]
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", "iterated layers")


_CUDNN_BENCHMARK_SEEN: list[bool] = []  # outside the module: optimize() runs a copy of the model


class _NotesCudnnBenchmark(nn.Module):
    """Notes cuDNN's benchmark flag each time it runs; its branch on a value keeps torch.fx from tracing it, so
    it runs as written inside the shape-propagation forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.fx.Proxy):  # a run, not the trace's attempt
            _CUDNN_BENCHMARK_SEEN.append(torch.backends.cudnn.benchmark)
        return x if x.abs().sum() >= 0 else -x


@pytest.mark.parametrize("user_setting", [True, False])
def test_the_shape_forward_runs_without_cudnn_benchmarking_and_restores_the_flag(monkeypatch, user_setting):
    """The shape-propagation forward's speed is not used: cuDNN's benchmark mode, which times every algorithm of
    each new conv shape, is off for it, and the user's setting is back afterwards, also when the model raises."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", user_setting)
    _CUDNN_BENCHMARK_SEEN.clear()
    model = nn.Sequential(seeded(ConvBnAct(F.silu, 3, 5, padding=1)), _NotesCudnnBenchmark()).eval()
    x = torch.randn(2, 3, 13, 11)
    fused = fuser.optimize(model, (x,), backend="torch")
    assert _CUDNN_BENCHMARK_SEEN == [False] and torch.backends.cudnn.benchmark is user_setting
    assert_close(fused(x), reference64(model, x), "ieee")
    with pytest.raises(ValueError, match="raised RuntimeError on the example inputs"):
        fuser.optimize(model, (torch.randn(2, 4, 13, 11),), backend="torch")  # 4 channels into a 3-channel conv
    assert torch.backends.cudnn.benchmark is user_setting


class Counter(nn.Module):
    """A module whose forward writes into its own buffer at every call (a call count that scales the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * (self.calls * 0.5).sqrt()


class CountedConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, 7)
        self.counter = Counter()
        self.head = ConvBnAct(nn.ReLU(), 7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.counter(self.block(x)))


def test_a_submodule_that_writes_its_buffer_runs_as_a_leaf_and_keeps_counting():
    """torch.fx runs such a write on the real tensor while tracing and records what follows from it as a
    constant: the module must run as it is, called from the graph, and the trace must leave the count alone."""
    model, x = seeded(CountedConvs()), torch.randn(2, 3, 11, 9)
    expected = copy.deepcopy(model)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert [c.ops for c in opt.fusion_report.fused] == [
        ["conv2d", "batch_norm", "silu"],
        ["conv2d", "batch_norm", "relu"],
    ], str(opt.fusion_report)
    with torch.no_grad():
        for _ in range(3):  # each call counts once more, in both
            assert_close(opt(x), expected(x), "ieee")
    assert model.counter.calls.item() == 1.0  # the user's model is not the one that counted


def test_a_root_that_writes_its_buffer_runs_as_it_is_and_says_why():
    model, x = seeded(Counter()), torch.randn(2, 3, 11, 9)
    opt = fuser.optimize(model, (x,), backend="torch")
    (entry,) = opt.fusion_report.untraced
    assert "writes into a buffer" in entry.reason and "`calls`" in entry.detail, entry
    with torch.no_grad():
        assert not torch.equal(opt(x), opt(x))  # it counts, as the original does


class CachedBiases(nn.Module):
    """timm's LeViT / EfficientViT attention biases: in eval mode the gathered table is cached in a dict by
    device, filled in place by the forward (while traced: with a proxy, under the key of a proxy device). Its
    forward then branches on a value, so it fails to trace after filling the cache, and runs as a leaf."""

    def __init__(self, c: int = 7) -> None:
        super().__init__()
        self.biases = nn.Parameter(torch.randn(c, 4))
        self.register_buffer("idxs", torch.tensor([0, 3, 1, 2, 2, 0]), persistent=False)
        self.attention_bias_cache: dict[str, torch.Tensor] = {}

    def get_biases(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.biases[:, self.idxs]
        return self.attention_bias_cache[key]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        out = y.flatten(2)[..., :6] + self.get_biases(y.device)
        return out if bool(out.amax() > -1e9) else -out


class BlockThenCachedBiases(nn.Module):
    def __init__(self, c: int = 7) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, c)
        self.attn = CachedBiases(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.block(x))


def test_a_cache_the_forward_fills_is_left_as_it_was_so_the_model_pickles(tmp_path):
    model, x = seeded(BlockThenCachedBiases()), torch.randn(2, 3, 11, 9)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert [c.ops for c in opt.fusion_report.fused] == [["conv2d", "batch_norm", "silu"]], str(opt.fusion_report)
    caches = [m.attention_bias_cache for m in opt.modules() if isinstance(m, CachedBiases)]
    assert caches and all(not any(isinstance(v, torch.fx.Proxy) for v in c.values()) for c in caches), caches
    torch.save(opt, tmp_path / "optimized.pt")
    loaded = torch.load(tmp_path / "optimized.pt", weights_only=False)
    with torch.no_grad():
        assert_close(loaded(x), reference64(model, x), "ieee")


class RotaryBlocks(nn.Module):
    """EVA-02's rotary embedding: a sin/cos table in a non-persistent buffer, split and applied again in every
    block. torch.fx computes the split while tracing (it does not proxy buffers) and stores each block's
    result as a new constant."""

    def __init__(self, blocks: int = 5, tokens: int = 9, dim: int = 6) -> None:
        super().__init__()
        table = torch.linspace(-1.0, 1.0, tokens * 2 * dim).view(tokens, 2 * dim)
        self.register_buffer("pos_embed", table, persistent=False)
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for proj in self.proj:
            sin, cos = self.pos_embed.tensor_split(2, -1)
            x = F.gelu(proj(x * cos + x.flip(-1) * sin))
        return x


def test_trace_time_constants_are_stored_once_and_out_of_the_state_dict():
    model, x = seeded(RotaryBlocks()), torch.randn(2, 9, 6)
    opt = fuser.optimize(model, (x,), backend="torch")
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")
    assert [c.ops for c in opt.fusion_report.fused] == [["linear", "gelu"]] * 5, str(opt.fusion_report)
    constants = [name for name, _ in opt.named_buffers() if "_tensor_constant" in name]
    assert len(constants) == 2, constants  # sin and cos, not one pair per block
    assert not [k for k in opt.state_dict() if "_tensor_constant" in k or k.endswith("pos_embed")]


class ScaledByTable(nn.Module):
    """A buffer left out of the state dict (``persistent=False``: derived, rebuilt by ``__init__``), as timm's
    LeViT index tables and torchvision's anchor grids are."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 5).view(1, 5, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x)) * self.table


def test_a_non_persistent_buffer_stays_out_of_the_state_dict():
    model = seeded(ScaledByTable())
    x = torch.randn(2, 3, 9, 11)
    opt = fuser.optimize(model, (x,), backend="torch")
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")
    assert not [k for k in opt.state_dict() if k.endswith("table")], sorted(opt.state_dict())
    assert any(name.endswith("table") for name, _ in opt.named_buffers())  # still there, and read


class KeywordsThrough(nn.Module):
    """A block whose forward takes ``**kwargs`` and is called with one it does not name (transformers' layers
    receive ``position_ids`` so): its traced graph could not be called so."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, 6)

    def forward(self, x: torch.Tensor, scale: float = 1.0, **kwargs: object) -> torch.Tensor:
        return self.block(x) * scale


class PassesKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = KeywordsThrough()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 100:  # untraceable here, so that the layer is captured on its own
            x = x / 2
        return self.layer(x, scale=0.5, position_ids=None)


def test_a_module_called_with_keywords_its_graph_lacks_is_captured_through_its_children():
    model = seeded(PassesKeywords())
    x = torch.randn(3, 3, 21, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    report = opt.fusion_report
    (entry,) = [u for u in report.untraced if u.path == "layer"]
    assert "keyword arguments (position_ids)" in entry.reason
    assert [e.location for e in report.fused] == ["layer.block.{conv,bn,act}"]
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")


class ReturnsOrderedDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, 6)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        y = self.block(x)
        return OrderedDict(features=y, pooled=y.mean((2, 3)))


def test_a_dict_subclass_output_keeps_its_type_through_save_and_load():
    model = seeded(ReturnsOrderedDict())
    x = torch.randn(3, 3, 21, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert opt.fusion_report.fused
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    for module in (opt, torch.load(buffer, weights_only=False)):
        with torch.no_grad():
            out = module(x)
        assert type(out) is OrderedDict and list(out) == ["features", "pooled"]
        assert_close(out["pooled"], reference64(model, x)["pooled"], "ieee")
