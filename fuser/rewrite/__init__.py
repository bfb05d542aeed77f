"""Rewriting: the graph passes that replace what was matched with fused modules.

chains          each accepted chain becomes one fused module with folded parameters
batchnorm_fold  conv -> BN(eval) folded into one conv's weight and bias
cat_buffers     fused convs store straight into the slices of the concatenation they feed
pool_pyramid    cat([x, pool(x), pool(pool(x)), ...]) as one kernel
"""
