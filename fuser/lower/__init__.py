"""Lowering: what a fused module runs, from its spec objects down to one kernel launch or torch reference.

fused_modules    FusedConv2d / FusedLinear: the folded parameters and spec objects of one fused op
ops              the fuser:: torch.library custom ops, the one place their schema flattens the specs
calls            the function that computes one fused op for every call shaped like an example one
backends         which implementation runs ("auto", "triton", "torch", "measured", ...) per device
kernel_dispatch  the one place the graph side calls the Triton launchers of fuser.kernels
path_choice      backend="measured": the faster of kernel and cuDNN / cuBLAS, measured once
references       the fused ops in plain torch (the "torch" backend and the tests' oracle)
conv_geometry    a convolution's stride, padding, dilation and groups as one value
"""
