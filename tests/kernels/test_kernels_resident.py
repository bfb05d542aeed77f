"""The resident-weight 3x3 conv (kernels/conv_resident.py): in the interpreter against float64 on odd shapes (boxes
cut by the image's edges, channel counts under the 64-wide blocks), its refusals by name, its compile for sm_90 on
the CPU (the nine weight tiles allocated in shared memory once, before the tile loop; each measured config's
shared memory within the H200's), and on the GPU against float64 at YOLOv8n's 64->64 @80 on every configuration
benchmarks/resident_weights.py measures."""

from __future__ import annotations

import re

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference
from test_kernels_compile import PTXAS, compile_sm90

from benchmarks.resident_weights import CONFIGS
from fuser.kernels import Activation, Epilogue, Residual, pack_conv_weight
from fuser.kernels.conv_resident import _conv3x3_resident_kernel, conv3x3_resident

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
PAD1 = (1, 1, 1, 1)
CASES = [
    ConvCase("c40_to_37_odd", 2, 40, 37, (11, 19), 3, padding=PAD1),
    ConvCase("c64_to_64_small", 1, 64, 64, (7, 17), 3, padding=PAD1),
    ConvCase("c8_to_5", 3, 8, 5, (5, 3), 3, padding=PAD1),
]


def resident_call(case: ConvCase, dtype: torch.dtype, precision: str, block_m: int, device: str = "cpu", **options):
    x, w, b, residual = conv_inputs(case, SILU_ADD, dtype, device=device)
    w = w.to(dtype)  # the reference multiplies what the kernel reads
    out = conv3x3_resident(x, pack_conv_weight(w, precision), b.float(), SILU_ADD, residual, block_m=block_m,
                           interpret=device == "cpu", **options)  # fmt: skip
    return out, conv_reference(x, w, b, case, SILU_ADD, residual)


@pytest.mark.parametrize(("dtype", "precision"), [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_resident_weights_match_float64(case: ConvCase, dtype: torch.dtype, precision: str) -> None:
    torch.manual_seed(3)
    out, ref = resident_call(case, dtype, precision, block_m=32)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref, precision, f"{case} {precision}")


def test_refusals_name_the_problem() -> None:
    x = torch.randn(1, 16, 5, 5).half().contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"\(1, 1\) filter"):
        conv3x3_resident(x, pack_conv_weight(torch.randn(8, 16, 1, 1).half(), "fp16"), interpret=True)
    with pytest.raises(ValueError, match="96 input / 8 output channels"):
        wide = torch.randn(1, 96, 5, 5).half().contiguous(memory_format=torch.channels_last)
        conv3x3_resident(wide, pack_conv_weight(torch.randn(8, 96, 3, 3).half(), "fp16"), interpret=True)
    with pytest.raises(ValueError, match="16-bit operands"):
        conv3x3_resident(x.float(), pack_conv_weight(torch.randn(8, 16, 3, 3), "tf32"), interpret=True)
    with pytest.raises(ValueError, match="dense channels_last"):
        conv3x3_resident(x.contiguous(), pack_conv_weight(torch.randn(8, 16, 3, 3).half(), "fp16"), interpret=True)
    with pytest.raises(ValueError, match="block_m=40"):
        conv3x3_resident(x, pack_conv_weight(torch.randn(8, 16, 3, 3).half(), "fp16"), block_m=40, interpret=True)


@pytest.mark.skipif(not PTXAS.exists(), reason=f"triton's bundled ptxas is not at {PTXAS}")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "m{}w{}s{}p{}".format(*c))
def test_the_weights_stay_in_shared_memory_across_tiles_on_sm90(config: tuple[int, int, int, int]) -> None:
    """The point of the kernel, checked in the compiled TTGIR of each measured config: each of the nine weight
    tiles is one shared-memory allocation made before the tile loop (none inside it), every dot reads its B
    operand from shared memory, and one program fits the H200's 227 KiB."""
    block_m, warps, stages, _ = config
    constexprs = {"HAS_BIAS": True, "ACT": int(Activation.SILU), "RESIDUAL": 0, "HAS_SCALE": False,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64,
                  "BOX_W": 16}  # fmt: skip
    pointers = {"x_desc": f"tensordesc<fp16[1, {block_m // 16}, 1, 16, 64]>", "w_ptr": "*fp16",
                "bias_ptr": "*fp32", "res_ptr": "*fp16", "out_ptr": "*fp16"}  # fmt: skip
    compiled = compile_sm90(_conv3x3_resident_kernel, pointers, constexprs, warps, stages)
    ttgir = compiled.asm["ttgir"]
    loop_start = ttgir.index("scf.for")
    weight_allocs = [m.start() for m in re.finditer(r"ttg\.local_alloc %\S+ : \(tensor<64x64xf16", ttgir)]
    assert len(weight_allocs) == 9 and all(at < loop_start for at in weight_allocs), weight_allocs
    dots = re.findall(r"ttng\.warp_group_dot .*?\* !ttg\.memdesc<64x64xf16", ttgir)
    assert len(dots) == 9, "each tap's dot reads its weight tile from shared memory"
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "m{}w{}s{}p{}".format(*c))
def test_gpu_resident_weights_match_float64(config: tuple[int, int, int, int]) -> None:
    """YOLOv8n's 64->64 @80 (batch 2 to keep the float64 reference quick) on the card, every measured config."""
    block_m, warps, stages, per_sm = config
    torch.manual_seed(4)
    case = ConvCase("yolo_64x64_80", 2, 64, 64, (80, 80), 3, padding=PAD1)
    out, ref = resident_call(case, torch.float16, "fp16", block_m, device="cuda", num_warps=warps,
                             num_stages=stages, programs_per_sm=per_sm)  # fmt: skip
    assert_close(out.cpu(), ref.cpu(), "fp16", str(config))
