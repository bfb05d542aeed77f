"""Running an optimized model: what wraps the forward pass rather than one fused op.

cuda_graphs      one replay of a recorded CUDA graph instead of one launch per kernel
torch_precision  torch's global precision flags for the unfused remainder, per precision policy
profiling        counting kernel launches and timing a forward pass (demo, benchmarks)
"""
