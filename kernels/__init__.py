"""fuser.kernels: fused Triton kernels (implicit-GEMM convolution, GEMM, depthwise convolution) with
their epilogues, and the launchers the graph side calls. No graph code lives here."""

from .autotune import set_cache_dir
from .conv import conv2d_act, conv2d_act_plan, conv2d_supported, conv2d_tile_candidates
from .epilogue import Activation, Epilogue, Residual
from .gemm import gemm_act, gemm_act_plan
from .packing import PackedConvWeight, PackedGemmWeight, pack_conv_weight, pack_gemm_weight
from .precision import Precision

__all__ = [
    "Activation",
    "Epilogue",
    "PackedConvWeight",
    "PackedGemmWeight",
    "Precision",
    "Residual",
    "conv2d_act",
    "conv2d_act_plan",
    "conv2d_supported",
    "conv2d_tile_candidates",
    "gemm_act",
    "gemm_act_plan",
    "pack_conv_weight",
    "pack_gemm_weight",
    "set_cache_dir",
]
