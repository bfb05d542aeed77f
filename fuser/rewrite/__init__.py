"""Rewriting: the graph passes that replace what was matched with fused modules.

chains          each accepted chain becomes one fused module with folded parameters
batchnorm_fold  conv -> BN(eval) folded into one conv's weight and bias
cat_buffers     fused convs store straight into the slices of the concatenation they feed
pool_pyramid    cat([x, pool(x), pool(pool(x)), ...]) as one kernel
max_pool        the other 2-D max pools as an NHWC kernel
channel_mean    spatial means (the SE pool) as one NHWC reduction kernel
depthwise_pool  a spatial mean of a depthwise conv's output summed in that conv's epilogue
virtual_cat     conv(cat([upsample(a), b])) reads a and b directly
input_scale     conv(x * s), s per image and channel, multiplies as it loads x
batchnorm_prologue  BN [-> act] before a fused conv or linear: its operand prologue, or folded into its weights
tf32_rounding   outputs only TF32 dots read are stored rounded; the other inputs' truncation compensated
detect_head     a YOLO detect head's inference tail as one kernel
node_pass       the walk, the replacement and the finish the per-node passes share
"""
