"""The halo 3x3 conv (kernels/conv_halo.py, Gluon): its refusals by name on the CPU; its compile for sm_90 on the
CPU (every tap's activation operand read by wgmma from shared memory, each measured config's shared memory within
the H200's) where the installed Triton accepts its shifted views, and the refusal where it does not; on the GPU
against float64 on odd shapes (tiles cut by the image's right and bottom edges, channel counts that leave a block
part empty) in fp16, bf16 and TF32, on every configuration benchmarks/halo_conv.py measures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference
from test_kernels_compile import PTXAS
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from benchmarks.halo_conv import CONFIGS, config_name
from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, pack_conv_weight
from fuser.kernels.conv_halo import (
    HaloTile,
    _conv3x3_halo_kernel,
    channel_blocks,
    conv3x3_halo,
    halo_refusal,
    halo_route,
    halo_tile,
    triton_refusal,
)

SILU = Epilogue(Activation.SILU)
PAD1 = (1, 1, 1, 1)
CASES = [
    ConvCase("c72_to_24_odd_tail", 2, 72, 24, (11, 19), 3, padding=PAD1),
    ConvCase("c80_to_80_head", 1, 80, 80, (21, 23), 3, padding=PAD1),
    ConvCase("c64_to_136_two_column_tiles", 1, 64, 136, (9, 35), 3, padding=PAD1),
]
PRECISIONS = [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "tf32")]


def compile_halo_sm90(dtype: str, tile: HaloTile, c_in: int, c_out: int, residual: int = 0):
    """The kernel compiled for an H100/H200-class target as :func:`prepare_halo` would specialize it:
    descriptors with its block shapes and layouts, the sizes as int32 arguments."""
    bh, bw = tile.box
    bits = {"fp16": 16, "bf16": 16, "fp32": 32}[dtype]
    block_k, tail = channel_blocks(c_in, bits // 8)
    narrow = tail or block_k
    block_n = tile.block_n or min(128, triton.next_power_of_2(c_out))
    swizzled = lambda k, rank: gl.NVMMASharedLayout(swizzle_byte_width=k * bits // 8, element_bitwidth=bits, rank=rank)
    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=4)

    def desc(shape: list[int], layout: object) -> str:
        return f"tensordesc<{dtype}[{', '.join(map(str, shape))}],{layout!r}>"

    signature = {
        "x_top": desc([1, bh, bw, block_k], swizzled(block_k, 4)),
        "x_bottom": desc([1, 2, bw, block_k], swizzled(block_k, 4)),
        "x_top_tail": desc([1, bh, bw, narrow], swizzled(narrow, 4)),
        "x_bottom_tail": desc([1, 2, bw, narrow], swizzled(narrow, 4)),
        "w_desc": desc([block_n, block_k], swizzled(block_k, 2)),
        "w_tail": desc([block_n, narrow], swizzled(narrow, 2)),
        "out_desc": desc([1, bh, bw, block_n], plain), "res_desc": desc([1, bh, bw, block_n], plain),
        "bias_ptr": "*fp32", "C_IN": "i32", "C_OUT": "i32", "tiles_h": "i32", "tiles_w": "i32", "alpha": "fp32",
        "scale": "fp32",
    }  # fmt: skip
    constexprs = {"HAS_BIAS": True, "ACT": int(Activation.SILU), "RESIDUAL": residual, "HAS_SCALE": False,
                  "ROUND_TF32": False, "BH": bh, "BW": bw, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "BLOCK_K_TAIL": narrow, "HAS_TAIL": tail > 0, "HALO_ROWS": triton.next_power_of_2(3 * (bh + 2)),
                  "W_BUFS": tile.weight_buffers, "num_warps": tile.num_warps}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = GluonASTSource(_conv3x3_halo_kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.num_warps})


def halo_call(
    case: ConvCase, dtype: torch.dtype, precision: str, device: str, tile: HaloTile = CONFIGS[0],
    epilogue: Epilogue = SILU,
):  # fmt: skip
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device=device)
    w = w.to(dtype)  # the reference multiplies what the kernel reads
    if residual is not None:  # a fused producer's output, as in a model: channels_last
        residual = residual.contiguous(memory_format=torch.channels_last)
    out = conv3x3_halo(x, pack_conv_weight(w, precision), b.float(), epilogue, residual, tile=tile)
    return out, conv_reference(x, w, b, case, epilogue, residual)


def test_refusals_name_the_problem() -> None:
    x = torch.randn(1, 64, 5, 5).half().contiguous(memory_format=torch.channels_last)
    w3 = pack_conv_weight(torch.randn(8, 64, 3, 3).half(), "fp16")
    assert "(1, 1) filter" in halo_refusal(x, pack_conv_weight(torch.randn(8, 64, 1, 1).half(), "fp16"))
    assert "a multiple of 16 bytes" in halo_refusal(x, pack_conv_weight(torch.randn(12, 64, 3, 3).half(), "fp16"))
    narrow = torch.randn(1, 48, 5, 5).half().contiguous(memory_format=torch.channels_last)
    assert "at least 128 bytes" in halo_refusal(narrow, pack_conv_weight(torch.randn(8, 48, 3, 3).half(), "fp16"))
    assert "torch.float32 input to torch.float16 weights" in halo_refusal(x.float(), w3)
    assert "tf32x3 precision" in halo_refusal(x.float(), pack_conv_weight(torch.randn(8, 64, 3, 3), "tf32x3"))
    assert "dense channels_last" in halo_refusal(x.contiguous(), w3)
    residual = torch.randn(1, 8, 5, 5).half()
    assert "a residual with strides" in halo_refusal(x, w3, residual)
    assert halo_refusal(x, w3, residual.contiguous(memory_format=torch.channels_last)) is None
    with pytest.raises(ValueError, match=r"box \(3, 16\)"):
        HaloTile((3, 16))
    with pytest.raises(ValueError, match="adds a residual but none was given"):
        conv3x3_halo(x, w3, epilogue=Epilogue(Activation.SILU, residual=Residual.AFTER_ACT))


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((32, 64, 64, 80, 80, 2), HaloTile((8, 16), None, 4, 8)), ((32, 64, 80, 80, 80, 4), HaloTile((8, 16), None, 2, 4)),
     ((32, 64, 64, 56, 56, 2), HaloTile((8, 16), None, 4, 8)), ((32, 32, 32, 80, 80, 4), HaloTile((8, 16), None, 4, 8)),
     ((32, 80, 80, 80, 80, 2), HaloTile((8, 16), None, 2, 4)), ((32, 80, 80, 80, 80, 4), HaloTile((8, 16), None, 2, 4)),
     ((32, 48, 64, 80, 80, 2), None), ((32, 32, 32, 80, 80, 2), None), ((32, 200, 64, 80, 80, 4), None),
     ((32, 64, 64, 40, 40, 2), None), ((1, 64, 64, 80, 80, 2), None), ((28, 64, 64, 56, 56, 2), None),
     ((32, 64, 192, 80, 80, 2), None), ((32, 80, 80, 40, 40, 2), HaloTile((8, 16), None, 2, 4)),
     ((32, 80, 80, 40, 40, 4), HaloTile((8, 16), None, 2, 4)), ((32, 80, 80, 20, 20, 2), None),
     ((16, 80, 80, 40, 40, 2), None)],
    ids=["yolo64-fp16", "head64to80-tf32", "resnet56-overhang-8-columns", "c32-tf32-one-block", "head80-tail-fp16",
         "head80-tail-tf32", "no-whole-block", "c32-fp16-half-block", "three-tf32-blocks", "narrow-cout-short-grid",
         "batch1-short-grid", "resnet56-short-grid", "wide-cout", "head80-at-40-fp16", "head80-at-40-tf32",
         "head80-at-20-overhangs", "head80-at-40-short-grid"],
)  # fmt: skip
def test_the_route_takes_only_the_measured_wins(shape: tuple, expected: HaloTile | None) -> None:
    assert halo_tile(*shape) == expected


def test_conv2d_act_routes_only_cuda_calls_and_honours_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (interpreter or not) nothing routes; on a CUDA-looking call the switch turns the route off."""
    x = torch.randn(32, 64, 80, 80).half().contiguous(memory_format=torch.channels_last)
    w = pack_conv_weight(torch.randn(64, 64, 3, 3).half(), "fp16")
    out = torch.empty(32, 80, 80, 64).half()
    args = (x, w, None, out, (1, 1), (1, 1, 1, 1), (1, 1))
    assert halo_route(*args) is None  # a CPU tensor
    monkeypatch.setattr(type(x), "device", property(lambda t: torch.device("cuda")))
    assert halo_route(*args) == (None if triton_refusal() else HaloTile((8, 16), None, 4, 8))
    assert halo_route(x, w, None, out, (2, 2), (1, 1, 1, 1), (1, 1)) is None
    monkeypatch.setenv("FUSER_HALO", "0")
    assert halo_route(*args) is None


def test_compile_ahead_builds_the_gluon_source_for_a_gluon_kernel() -> None:
    """The compile-ahead workers (precompile.py) must file the halo kernel under the key the JIT looks up: from
    a GluonASTSource, as the JIT builds it, not a Triton ASTSource."""
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from fuser.kernels import conv, precompile

    variant = precompile.Variant("fuser.kernels.conv_halo:_conv3x3_halo_kernel", {}, {}, {}, {}, None)
    assert type(precompile._source(variant, _conv3x3_halo_kernel)) is GluonASTSource
    assert type(precompile._source(variant, conv._conv2d_act_kernel)) is ASTSource


@pytest.mark.skipif(not PTXAS.exists(), reason=f"triton's bundled ptxas is not at {PTXAS}")
@pytest.mark.skipif(
    triton_refusal() is not None,
    reason=f"triton {triton.__version__} refuses the kernel (test_the_triton_gate_names_the_version checks how)",
)
@pytest.mark.parametrize("tile", CONFIGS, ids=config_name)
def test_every_tap_reads_its_operand_from_shared_memory_on_sm90(tile: HaloTile) -> None:
    """The point of the kernel, in the compiled code of each measured config (fp16, 80 output channels): the
    activation boxes arrive through 4-D TMA copies, no shared-memory load feeds a register operand (each tap's
    wgmma reads both operands from shared memory), and one program fits the H200's 227 KiB."""
    compiled = compile_halo_sm90("fp16", tile, 80, 80)
    ptx = compiled.asm["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global", ptx)
    assert "wgmma.mma_async" in ptx and not re.search(r"\bld(matrix\S*)?\.shared", ptx)
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    with_residual = compile_halo_sm90("fp16", tile, 64, 80, residual=int(Residual.AFTER_ACT)).asm["ptx"]
    assert re.search(r"\bld(matrix\S*)?\.shared", with_residual)  # the residual box, read from the output buffer


def test_the_triton_gate_names_the_version() -> None:
    """The launcher refuses by name where the installed Triton rejects the kernel, and only there: on a Triton
    other than 3.6 the compile for sm_90 must fail with the shifted views' error (in a child process: the failed
    MLIR compile leaves nanobind objects that its exit reports as leaks). When a Triton accepts them, this fails
    and the gate can be lifted."""
    why = triton_refusal()
    if triton.__version__.startswith("3.6"):
        assert why is None
        return
    assert why is not None and triton.__version__ in why
    x = torch.randn(1, 64, 5, 5).half().contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=re.escape(triton.__version__)):
        conv3x3_halo(x, pack_conv_weight(torch.randn(8, 64, 3, 3).half(), "fp16"))
    if not PTXAS.exists():
        pytest.skip(f"triton's bundled ptxas is not at {PTXAS}: the refused compile cannot be shown")
    here = Path(__file__).parent
    script = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        "from test_kernels_halo import CONFIGS, compile_halo_sm90; compile_halo_sm90('fp16', CONFIGS[0], 80, 80)"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode != 0 and "exceeds the source view" in child.stderr, child.stderr[-2000:]
    assert "3.6" in triton_refusal.__doc__


EPILOGUES = [SILU, Epilogue(Activation.SILU, residual=Residual.AFTER_ACT),
             Epilogue(Activation.RELU, residual=Residual.BEFORE_ACT, scale=0.5)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "precision"), PRECISIONS, ids=lambda p: str(p).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=["silu", "silu-add", "add-relu-scale"])
def test_gpu_halo_matches_float64(case: ConvCase, dtype: torch.dtype, precision: str, epilogue: Epilogue) -> None:
    torch.manual_seed(5)
    out, ref = halo_call(case, dtype, precision, "cuda", epilogue=epilogue)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out.cpu(), ref.cpu(), precision, f"{case} {precision} {epilogue.describe()}")


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "precision"), [PRECISIONS[0], PRECISIONS[2]], ids=["fp16", "tf32"])
@pytest.mark.parametrize("tile", CONFIGS, ids=config_name)
def test_gpu_every_measured_config_matches_float64(tile: HaloTile, dtype: torch.dtype, precision: str) -> None:
    """The head's 80->80 on a 37 x 45 image (batch 2), every tile benchmarks/halo_conv.py times."""
    torch.manual_seed(6)
    case = ConvCase("head_80_37x45", 2, 80, 80, (37, 45), 3, padding=PAD1)
    out, ref = halo_call(case, dtype, precision, "cuda", tile)
    assert_close(out.cpu(), ref.cpu(), precision, f"{config_name(tile)} {precision}")


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "precision"), [PRECISIONS[0], PRECISIONS[2]], ids=["fp16", "tf32"])
def test_gpu_conv2d_act_routes_to_the_halo_kernel_into_a_channel_slice(dtype: torch.dtype, precision: str) -> None:
    """A routed call (YOLOv8n's 64->64 @80 at batch 21: 1050 tiles, over the route's 896) through conv2d_act
    with a residual, writing a channel slice of a wider channels_last buffer as a concatenation would; the slice's
    neighbours stay untouched."""
    torch.manual_seed(7)
    case = ConvCase("yolo_64_80_routed", 21, 64, 64, (80, 80), 3, padding=PAD1)
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    w, residual = w.to(dtype), residual.contiguous(memory_format=torch.channels_last)
    packed = pack_conv_weight(w, precision)
    assert halo_route(x, packed, residual, x.permute(0, 2, 3, 1), (1, 1), (1, 1, 1, 1), (1, 1)) is not None
    buf = torch.full((21, 80, 80, 96), 7.0, dtype=dtype, device="cuda").permute(0, 3, 1, 2)
    out = conv2d_act(x, packed, b.float(), padding=1, epilogue=epilogue, residual=residual, out=buf[:, 16:80])
    ref = conv_reference(x, w, b, case, epilogue, residual)
    assert_close(out.cpu(), ref.cpu(), precision, f"routed {precision}")
    assert bool((buf[:, :16] == 7).all()) and bool((buf[:, 80:] == 7).all())
    # the plan's later calls launch the compiled kernel directly (LaunchOptions), with new tensors each time
    x2, residual2 = (t.flip(0).contiguous(memory_format=torch.channels_last) for t in (x, residual))
    buf2 = torch.empty_like(buf)
    again = conv2d_act(x2, packed, b.float(), padding=1, epilogue=epilogue, residual=residual2, out=buf2[:, 16:80])
    assert_close(again.cpu(), conv_reference(x2, w, b, case, epilogue, residual2).cpu(), precision, "direct launch")


def test_the_report_names_the_halo_route_only_where_a_call_could_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report knows the layer, not the call: a 3x3/s1/p1 conv whose channels the route accepts is named with
    "or the halo conv" on a machine that could run it (a GPU, triton 3.6), and only there."""
    from fuser.kernels import conv_halo
    from fuser.lower.kernel_dispatch import kernel_name

    conv = {"in_channels": 64, "out_channels": 64, "kernel_size": (3, 3), "stride": (1, 1), "padding": 1}
    plain = kernel_name("conv", **conv)
    assert "halo" not in plain or (triton_refusal() is None and torch.cuda.is_available())
    monkeypatch.setattr(conv_halo, "triton_refusal", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_name("conv", **conv).endswith(", or the halo conv on large grids")
    assert "halo" not in kernel_name("conv", **{**conv, "stride": (2, 2)})
    assert "halo" not in kernel_name("conv", **{**conv, "in_channels": 24})  # under one block in fp16 and float32
    assert "halo" not in kernel_name("conv", **{**conv, "out_channels": 192})
    assert "halo" not in kernel_name("conv", **{**conv, "padding": 0})
    for same in ("same", (1, 1), (1, 1, 1, 1)):  # every form of the fused module's (1, 1, 1, 1)
        assert "halo" in kernel_name("conv", **{**conv, "padding": same}), same
    assert "halo" not in kernel_name("conv", **{**conv, "dilation": (2, 2)})  # the route takes dilation 1 only
    assert "halo" not in kernel_name("conv", **{**conv, "padding": "same", "dilation": (2, 2)})
    assert "halo" not in kernel_name("conv", **conv, compiled=False)  # the interpreter backend
