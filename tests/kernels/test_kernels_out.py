"""Preallocated outputs: every kernel path stores inside ``out`` and nowhere else (a poisoned guard band
around a channel slice), and two convs writing two channel slices of one buffer equal torch.cat."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_output_hw, conv_reference, gemm_reference

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight
from fuser.kernels.autotune import TileConfig

EPILOGUE = Epilogue(Activation.HARDSWISH, residual=Residual.AFTER_ACT)
GUARD = 36  # elements of poison before and after the buffer (a multiple of 4: 16-byte aligned slices)


def poisoned_slice(n: int, c: int, oh: int, ow: int, before: int, after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled flat buffer and, inside it, an ``[n, c, oh, ow]`` channels_last view that is channels
    ``before:before + c`` of an NHWC buffer with ``before + c + after`` channels, ``GUARD`` elements in."""
    total = before + c + after
    flat = torch.full((2 * GUARD + n * oh * ow * total,), float("nan"))
    nhwc = flat[GUARD : GUARD + n * oh * ow * total].view(n, oh, ow, total)
    return flat, nhwc[..., before : before + c].permute(0, 3, 1, 2)


def assert_band_untouched(flat: torch.Tensor, out: torch.Tensor) -> None:
    """Every element of ``flat`` outside ``out`` (a view of it) is still NaN."""
    positions = torch.as_strided(torch.arange(flat.numel()), out.shape, out.stride(), out.storage_offset())
    inside = torch.zeros(flat.numel(), dtype=torch.bool)
    inside[positions.reshape(-1)] = True
    assert int(inside.sum()) == out.numel()
    band = flat[~inside]
    assert torch.isnan(band).all(), f"{int((~torch.isnan(band)).sum())} stores outside out"


# One case per path: direct, depthwise, 1x1 GEMM (pointer and descriptor), flat K, channel blocks
# (pointer and descriptor), split-K; channel counts odd where the path allows.
OUT_CASES = [
    (ConvCase("direct_stem", 2, 3, 7, (9, 11), 3, stride=2, padding=(1, 1, 1, 1)), "auto", None),
    (ConvCase("depthwise", 2, 5, 5, (9, 11), 3, padding=(1, 1, 1, 1), groups=5), "auto", None),
    (ConvCase("pointwise", 2, 19, 7, (9, 11), 1), "pointer", None),
    (ConvCase("pointwise_desc", 2, 20, 8, (9, 11), 1), "descriptor", None),
    (ConvCase("flat_k", 2, 5, 7, (9, 11), 3, padding=(1, 1, 1, 1)), "pointer", None),
    (ConvCase("cblock", 2, 19, 7, (9, 11), 3, padding=(1, 1, 1, 1)), "pointer", None),
    (ConvCase("cblock_desc", 2, 20, 8, (9, 11), 3, padding=(1, 1, 1, 1)), "descriptor", None),
    (ConvCase("split_k", 1, 19, 7, (5, 7), 3, padding=(1, 1, 1, 1)), "pointer", TileConfig(32, 16, 16, 2, 4, 1, 2)),
]


def run_into(
    case: ConvCase, out: torch.Tensor | None, path: str, tile: TileConfig | None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x, w, b, residual = conv_inputs(case, EPILOGUE)
    got = conv2d_act(
        x, pack_conv_weight(w, "ieee", groups=case.groups), b, stride=case.stride, padding=case.padding,
        dilation=case.dilation, epilogue=EPILOGUE, residual=residual, out=out, interpret=True, path=path, tile=tile,
    )  # fmt: skip
    return got, conv_reference(x, w, b, case, EPILOGUE, residual)


@pytest.mark.parametrize(("case", "path", "tile"), OUT_CASES, ids=[c.name for c, _, _ in OUT_CASES])
def test_conv_stores_only_inside_out(case: ConvCase, path: str, tile: TileConfig | None) -> None:
    oh, ow = conv_output_hw(case)
    before = 4 if path == "descriptor" else 3  # the descriptor path needs 16-byte aligned rows
    flat, out = poisoned_slice(case.batch, case.c_out, oh, ow, before, 4 if path == "descriptor" else 5)
    got, ref = run_into(case, out, path, tile)
    assert got.data_ptr() == out.data_ptr() and got.stride() == out.stride()
    assert_close(out, ref, "ieee", case.name)
    assert_band_untouched(flat, out)


def test_two_convs_into_one_concat_buffer() -> None:
    """A 1x1 GEMM conv and an implicit-GEMM conv write channels 0:7 and 7:16 of one buffer: the buffer is
    bit for bit torch.cat of the two convs run on their own."""
    a = ConvCase("a_pointwise", 2, 19, 7, (9, 11), 1)
    b = ConvCase("b_3x3", 2, 19, 9, (9, 11), 3, padding=(1, 1, 1, 1))
    buf = torch.full((2, 9, 11, 16), float("nan")).permute(0, 3, 1, 2)
    run_into(a, buf[:, :7], "pointer", None, seed=1)
    run_into(b, buf[:, 7:], "pointer", None, seed=2)
    alone = torch.cat([run_into(a, None, "pointer", None, seed=1)[0], run_into(b, None, "pointer", None, seed=2)[0]], 1)
    assert torch.equal(buf, alone)


def test_gemm_stores_only_inside_out() -> None:
    a = torch.randn(3, 7, 45)
    w, bias = torch.randn(21, 45) / 45**0.5, torch.randn(21)
    residual = torch.randn(3, 7, 21)
    flat = torch.full((2 * GUARD + 21 * 30,), float("nan"))
    out = flat[GUARD : GUARD + 21 * 30].view(3, 7, 30)[..., 5:26]  # a column slice: row stride 30
    for tile in (None, TileConfig(16, 16, 16, 1, 4, 1, split_k=2)):
        flat[GUARD : GUARD + 21 * 30] = float("nan")
        got = gemm_act(a, pack_gemm_weight(w, "ieee"), bias, epilogue=EPILOGUE, residual=residual, out=out,
                       interpret=True, tile=tile)  # fmt: skip
        assert got is out
        assert_close(out, gemm_reference(a, w, bias, EPILOGUE, residual), "ieee", f"gemm out {tile}")
        assert_band_untouched(flat, out)


def test_out_errors() -> None:
    x = torch.randn(1, 5, 9, 9)
    w = pack_conv_weight(torch.randn(7, 5, 3, 3), "ieee")
    with pytest.raises(ValueError, match=r"out must have the output's shape \(1, 7, 7, 7\)"):
        conv2d_act(x, w, out=torch.empty(1, 7, 9, 9), interpret=True)
    with pytest.raises(ValueError, match=r"out must be torch\.float32"):
        conv2d_act(x, w, out=torch.empty(1, 7, 7, 7, dtype=torch.float16), interpret=True)
    with pytest.raises(ValueError, match="must hold channels contiguously"):
        conv2d_act(x, w, out=torch.empty(1, 7, 7, 7), interpret=True)  # NCHW: channels 49 apart
    with pytest.raises(ValueError, match="must hold channels contiguously"):
        gemm_act(
            torch.randn(7, 5), pack_gemm_weight(torch.randn(3, 5), "ieee"), out=torch.empty(3, 7).t(), interpret=True
        )


def test_plans_keep_no_tensor_of_the_call_they_were_made_for() -> None:
    """A plan made inside a CUDA-graph recording (torch.compile's reduce-overhead mode) must not keep the
    example's tensors alive: the recording refuses live allocations it does not own."""
    import gc
    import weakref

    from fuser.kernels import conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight

    x = torch.randn(2, 19, 9, 7).contiguous(memory_format=torch.channels_last)
    s = torch.rand(2, 19, 1, 1)
    conv = pack_conv_weight(torch.randn(13, 19, 1, 1), "ieee")
    a, sa = torch.randn(2, 5, 19), torch.rand(2, 19)
    gemm = pack_gemm_weight(torch.randn(11, 19), "ieee")
    outs = [conv2d_act(x, conv, interpret=True, input_scale=s), gemm_act(a, gemm, interpret=True, input_scale=sa)]
    refs = [weakref.ref(t) for t in (x, s, a, sa, *outs)]
    del x, s, a, sa, outs
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


def test_compiled_plans_with_a_fallback_keep_no_example_tensor() -> None:
    """A GPU plan (not the interpreter's) keeps its tile runner for the out-of-resources fallback: that runner
    must not hold the example call's tensors either (built here on CPU tensors, never launched)."""
    import gc
    import weakref

    from fuser.kernels import Epilogue, Precision, conv, gemm, pack_conv_weight, pack_gemm_weight

    x = torch.randn(2, 9, 7, 19).permute(0, 3, 1, 2)  # channels_last [N, C, H, W]
    out_nhwc = torch.empty(2, 9, 7, 13)
    bias = torch.randn(13)
    packed = pack_conv_weight(torch.randn(13, 19, 3, 3), "tf32")
    plans = [conv.prepare_implicit_gemm("conv2d_act", x, packed, bias, Epilogue(), None, out_nhwc, (1, 1),
                                        (1, 1, 1, 1), (1, 1), False, "pointer")]  # fmt: skip
    a3, out2 = torch.randn(1, 37, 19), torch.empty(37, 11)
    w = pack_gemm_weight(torch.randn(11, 19), "tf32").data
    plans.append(gemm.prepare_gemm("gemm_act", a3, w, 11, Precision("tf32"), bias, Epilogue(), None, out2, False,
                                   "pointer"))  # fmt: skip
    refs = [weakref.ref(t) for t in (x, out_nhwc, bias, a3, out2)]
    del x, out_nhwc, bias, a3, out2
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    assert all(callable(p) for p in plans)
