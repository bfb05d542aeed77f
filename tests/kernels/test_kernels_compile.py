"""The kernels compiled for sm_90 (Hopper) on the CPU, without a GPU: Triton's frontend and backend passes
down to PTX and ptxas. The interpreter runs the kernels' Python and is lax about types; this catches what
only the compiler refuses (a tensor descriptor passed through a helper, a loop bound of the wrong type in
one split variant) and checks that the dot reaches the tensor cores."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuser.kernels import channel_mean, conv, depthwise, gemm, splitk

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason=f"triton's bundled ptxas is not at {PTXAS}")

EPILOGUE = {"HAS_BIAS": True, "ACT": 4, "RESIDUAL": 2, "HAS_SCALE": True}
NO_PROLOGUE = {"PROLOGUE": 0}
CHANNEL_SCALE = {"PROLOGUE": 1}  # tiles.PROLOGUE_CHANNEL_SCALE
AFFINE_RELU = {"PROLOGUE": 16 + 1}  # tiles.PROLOGUE_AFFINE + Activation.RELU
AFFINE_SILU = {"PROLOGUE": 16 + 4}  # tiles.PROLOGUE_AFFINE + Activation.SILU


def compile_sm90(
    kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], warps: int = 4, stages: int = 3
) -> Any:
    """Compile ``kernel`` with the given pointer / descriptor argument types (other arguments i32, or fp32
    for the epilogue scalars) and constexprs, for an H100/H200-class target."""
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}  # tile(): BOX_W
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("alpha", "scale") else "i32"
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


SPLIT_POINTERS = {"ws_ptr": "*fp32", "count_ptr": "*i32"}


def assert_split_reduction(ptx: str, split_k: int, tail: bool = True) -> None:
    """A split kernel whose last program reduces counts arrivals with an acquire-release add at GPU scope
    (what orders the partial sums' stores before the last program's loads) and reads the partials from L2;
    a whole one, or one that leaves the sum to the reduction kernel, has no atomics."""
    if split_k > 1 and tail:
        count = re.search(r"\batom\.[\w.]*\.add\b", ptx)
        assert count and ".acq_rel" in count[0] and ".gpu" in count[0], f"no acq_rel arrival count: {count}"
        assert "ld.global.cg" in ptx, "the partial sums are not read from L2"
    else:
        assert "atom." not in ptx


def tile(
    block_m: int, block_n: int, block_k: int, split_k: int, tail: bool = True, stream_k: bool = False
) -> dict[str, Any]:
    """A tile's constexprs; ``tail``: a split's last program reduces (else splitk.py's reduction kernel)."""
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8, "SPLIT_K": split_k,
            "SPLIT_TAIL": tail, "BOX_W": 0, "STREAM_K": stream_k, "TAP_SHIFT": False}  # fmt: skip


@pytest.mark.parametrize(
    "prologue", [NO_PROLOGUE, CHANNEL_SCALE, AFFINE_RELU], ids=["plain", "channel_scale", "affine_relu"]
)
@pytest.mark.parametrize("split_k", [1, 2], ids=["whole", "split"])
def test_gemm_descriptor_path_compiles(split_k: int, prologue: dict[str, int]) -> None:
    pointers = {
        "a_ref": "tensordesc<fp32[64, 32]>",
        "w_ref": "tensordesc<fp32[64, 32]>",
        "bias_ptr": "*fp32",
        "res_ptr": "*fp32",
        "c_ref": "tensordesc<fp32[64, 64]>",
        "ps_ptr": "*fp32",
        **SPLIT_POINTERS,
    }
    constexprs = {**EPILOGUE, **prologue, "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": True,
                  **tile(64, 64, 32, split_k)}  # fmt: skip
    compiled = compile_sm90(gemm._gemm_act_kernel, pointers, constexprs)
    assert "wgmma" in compiled.asm["ptx"] or "mma.sync" in compiled.asm["ptx"]
    assert_split_reduction(compiled.asm["ptx"], split_k)


@pytest.mark.parametrize(
    ("k_order", "split_k", "prologue", "virtual"),
    [(0, 4, NO_PROLOGUE, False), (1, 1, NO_PROLOGUE, False), (0, 1, CHANNEL_SCALE, True),
     (1, 2, CHANNEL_SCALE, False), (0, 1, AFFINE_RELU, False), (1, 2, AFFINE_SILU, False),
     (2, 1, NO_PROLOGUE, False), (2, 2, AFFINE_RELU, False), (0, 16, NO_PROLOGUE, False)],
    ids=["channel-blocks-split", "flat-k", "virtual-cat-scaled", "flat-k-scaled-split", "affine-relu",
         "flat-k-affine-silu-split", "filter-rows", "filter-rows-affine-split", "split-16-reduction-kernel"],
)  # fmt: skip
def test_conv_pointer_path_compiles(k_order: int, split_k: int, prologue: dict[str, int], virtual: bool) -> None:
    pointers = {"x_ptr": "*bf16", "w_ref": "*bf16", "bias_ptr": "*fp32", "res_ptr": "*bf16", "ps_ptr": "*bf16"}
    pointers.update(out_ref="*bf16", x2_ptr="*bf16", **SPLIT_POINTERS)
    constexprs = {"KH": 3, "KW": 3, "K_ORDER": k_order, **EPILOGUE, **prologue, "VIRTUAL_CAT": virtual, "UP": 2,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": False,
                  **tile(64, 64, 32, split_k, tail=split_k < 16)}  # fmt: skip
    compiled = compile_sm90(conv._conv2d_act_kernel, pointers, constexprs)
    assert "wgmma" in compiled.asm["ptx"] or "mma.sync" in compiled.asm["ptx"]
    assert_split_reduction(compiled.asm["ptx"], split_k, tail=split_k < 16)


@pytest.mark.parametrize("split_k", [1, 3], ids=["whole", "split"])
def test_conv_filter_rows_through_descriptors_compile(split_k: int) -> None:
    """The filter-row order reads the weights through a tensor descriptor at each row's first column (not
    16-element aligned) and the A operand from registers: it compiles to a tensor-core dot. Split, the last
    program's store goes through the output descriptor inside the branch the arrival count takes."""
    pointers = {"x_ptr": "*fp16", "w_ref": "tensordesc<fp16[64, 32]>", "bias_ptr": "*fp32", "res_ptr": "*fp16",
                "out_ref": "tensordesc<fp16[64, 64]>", "ps_ptr": "*fp16", "x2_ptr": "*fp16",
                **SPLIT_POINTERS}  # fmt: skip
    constexprs = {"KH": 7, "KW": 7, "K_ORDER": 2, **EPILOGUE, **NO_PROLOGUE, "VIRTUAL_CAT": False, "UP": 1,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": True, **tile(64, 64, 32, split_k)}  # fmt: skip
    compiled = compile_sm90(conv._conv2d_act_kernel, pointers, constexprs)
    assert "wgmma" in compiled.asm["ptx"] or "mma.sync" in compiled.asm["ptx"]
    assert_split_reduction(compiled.asm["ptx"], split_k)


@pytest.mark.parametrize(("dtype", "block_k"), [("fp16", 64), ("fp32", 32)])
def test_conv_stream_k_compiles_to_pipelined_wgmma_with_an_ordered_fixup(dtype: str, block_k: int) -> None:
    """Stream-K (conv.py): the tile loop around the reduction loop keeps the inner loop pipelined (several
    weight tiles in flight through TMA) on wgmma, and a shared tile's fixup counts arrivals with an
    acquire-release add and reads the partial sums from L2."""
    pointers = {"x_ptr": f"*{dtype}", "w_ref": f"tensordesc<{dtype}[128, {block_k}]>", "bias_ptr": "*fp32",
                "res_ptr": f"*{dtype}", "out_ref": f"tensordesc<{dtype}[128, 128]>", "ps_ptr": f"*{dtype}",
                "x2_ptr": f"*{dtype}", **SPLIT_POINTERS}  # fmt: skip
    constexprs = {"KH": 3, "KW": 3, "K_ORDER": 0, **EPILOGUE, **NO_PROLOGUE, "VIRTUAL_CAT": False, "UP": 1,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": True,
                  **tile(128, 128, block_k, 1, stream_k=True)}  # fmt: skip
    compiled = compile_sm90(conv._conv2d_act_kernel, pointers, constexprs, warps=8)
    assert "wgmma" in compiled.asm["ptx"]
    assert_split_reduction(compiled.asm["ptx"], 2)
    weight_copies = [line for line in compiled.asm["ttgir"].splitlines() if "async_tma_copy_global_to_local" in line]
    assert len(weight_copies) >= 2, "the weight loads are not pipelined TMA copies"


@pytest.mark.parametrize(("dtype", "block_k"), [("fp16", 64), ("fp32", 32)])
def test_conv_box_tiles_compile_to_pipelined_tma_and_wgmma(dtype: str, block_k: int) -> None:
    """Box tiles (conv_boxes.py): the activation tile of each tap is a 5-D descriptor load of a box of 8 output
    rows x 16 columns, issued as asynchronous TMA copies (pipelined across steps) next to the weights', and
    the dot runs on wgmma; the output leaves through pointers (a box's rows are not one block of the output)."""
    box = f"tensordesc<{dtype}[1, 8, 1, 16, {block_k}]>"
    pointers = {"x_ptr": box, "w_ref": f"tensordesc<{dtype}[128, {block_k}]>", "bias_ptr": "*fp32",
                "res_ptr": f"*{dtype}", "out_ref": f"*{dtype}", "ps_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}",
                **SPLIT_POINTERS}  # fmt: skip
    constexprs = {"KH": 3, "KW": 3, "K_ORDER": 0, **EPILOGUE, **NO_PROLOGUE, "VIRTUAL_CAT": False, "UP": 1,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": True, **tile(128, 128, block_k, 1),
                  "BOX_W": 16}  # fmt: skip
    compiled = compile_sm90(conv._conv2d_act_kernel, pointers, constexprs, warps=8)
    ttgir = compiled.asm["ttgir"]
    box_copies = [line for line in ttgir.splitlines() if "async_tma_copy_global_to_local %x_ptr" in line]
    assert len(box_copies) >= 2, "the box loads are not pipelined TMA copies"
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared" not in compiled.asm["ptx"]  # no descriptor store of the output


@pytest.mark.parametrize(("dtype", "block_k"), [("fp16", 64), ("fp32", 32)])
def test_conv_shifted_taps_reach_wgmma_from_shared_memory(dtype: str, block_k: int) -> None:
    """Shifted taps over a zero-bordered input (conv_boxes.py): each tap's activation tile is a 2-D descriptor load
    of 128 consecutive bordered rows, issued as asynchronous TMA copies pipelined across steps, and with no mask
    to apply it reaches wgmma from shared memory, as in a plain GEMM; the output leaves through pointers (the
    bordered rows are not one block of the output's)."""
    from benchmarks.box_tiles import a_operand

    pointers = {"x_ptr": f"tensordesc<{dtype}[128, {block_k}]>", "w_ref": f"tensordesc<{dtype}[128, {block_k}]>",
                "bias_ptr": "*fp32", "res_ptr": f"*{dtype}", "out_ref": f"*{dtype}", "ps_ptr": f"*{dtype}",
                "x2_ptr": f"*{dtype}", **SPLIT_POINTERS}  # fmt: skip
    constexprs = {"KH": 3, "KW": 3, "K_ORDER": 0, **EPILOGUE, **NO_PROLOGUE, "VIRTUAL_CAT": False, "UP": 1,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "USE_DESC": True, **tile(128, 128, block_k, 1),
                  "TAP_SHIFT": True}  # fmt: skip
    compiled = compile_sm90(conv._conv2d_act_kernel, pointers, constexprs, warps=8)
    ttgir = compiled.asm["ttgir"]
    tap_copies = [line for line in ttgir.splitlines() if "async_tma_copy_global_to_local %x_ptr" in line]
    assert len(tap_copies) >= 2, "the shifted tap loads are not pipelined TMA copies"
    assert a_operand([compiled]) == "shared"
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared" not in compiled.asm["ptx"]


def test_box_of_one_row_reaches_wgmma_from_shared_memory() -> None:
    """A box of one output row loads as ``[1, 1, 1, BOX_W, BLOCK_K]`` and its reshape to the dot's tile only
    drops unit dimensions: triton keeps it in shared memory, where wgmma reads it (benchmarks/box_tiles.py's
    check, which also shows that a box of several rows goes through the registers on triton 3.6 and 3.9)."""
    from benchmarks.box_tiles import operands_on_cpu

    operands = operands_on_cpu(boxes={"1 row x 64": (64, 64)}, dtypes=(("fp16", 64),))["operands"]
    assert operands == {"fp16 row tiles (pointer gather)": "shared", "fp16 box 1 row x 64": "shared"}


def test_split_k_reduction_kernel_compiles() -> None:
    pointers = {"ws_ptr": "*fp32", "bias_ptr": "*fp32", "res_ptr": "*fp16", "out_ptr": "*fp16"}
    constexprs = {"SPLIT_K": 16, **EPILOGUE, "BLOCK_M": 32, "BLOCK_N": 64}
    assert compile_sm90(splitk._split_k_reduce_kernel, pointers, constexprs).asm["ptx"]


@pytest.mark.parametrize(
    "prologue", [NO_PROLOGUE, CHANNEL_SCALE, AFFINE_RELU], ids=["plain", "channel_scale", "affine_relu"]
)
@pytest.mark.parametrize("pool", [0, 1, 2], ids=["no-pool", "pool-partials", "pool-mean"])  # depthwise.POOL_*
def test_depthwise_compiles(prologue: dict[str, int], pool: int) -> None:
    pointers = {"x_ptr": "*fp16", "w_ptr": "*fp16", "bias_ptr": "*fp32", "res_ptr": "*fp16", "out_ptr": "*fp16"}
    pointers["ps_ptr"] = "*fp16"
    pointers["pool_ptr"] = "*fp32" if pool == 1 else "*fp16"  # the float32 partial sums, or the mean itself
    constexprs = {"KH": 3, "KW": 3, **EPILOGUE, **prologue, "POOL": pool, "BLOCK_M": 64, "BLOCK_N": 32}
    assert compile_sm90(depthwise._depthwise_act_kernel, pointers, constexprs).asm["ptx"]


@pytest.mark.parametrize("final", [True, False], ids=["one-split", "partial-sums"])
def test_channel_mean_compiles(final: bool) -> None:
    pointers = {"x_ptr": "*fp16", "dst_ptr": "*fp16" if final else "*fp32"}
    constexprs = {"FINAL": final, "BLOCK_P": 32, "BLOCK_C": 64}
    assert compile_sm90(channel_mean._channel_sum_kernel, pointers, constexprs).asm["ptx"]
    pointers = {"part_ptr": "*fp32", "out_ptr": "*fp16"}
    assert compile_sm90(channel_mean._add_splits_kernel, pointers, {"BLOCK_S": 32, "BLOCK_C": 64}).asm["ptx"]


def test_pool_pyramid_compiles_with_its_window_rows_as_a_loop() -> None:
    """SPPF's kernel (radii 0, 2, 4, 6): rows of the 13x13 window are a runtime loop, so the compiled
    kernel holds one unrolled row of taps, not all 169."""
    from fuser.kernels import pool

    radii = {"R0": 0, "R1": 2, "R2": 4, "R3": 6, "R_MAX": 6, "SLICES": 4, "BLOCK_M": 16, "BLOCK_C": 32}
    compiled = compile_sm90(pool._max_pool_pyramid_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, radii)
    ptx = compiled.asm["ptx"]
    assert ptx.count("ld.global") < 13 * 13, "the window's rows were unrolled"
