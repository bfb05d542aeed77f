"""Which tensors a first compiled forward of a fused model leaves alive (GPU): what makes torch.compile's
mode="reduce-overhead" refuse it ("tensors in the cudagraph pool not tracked as outputs").

    python -m benchmarks.compile_leaks --models yolov8n,efficientnet_b0
    python -m benchmarks.compile_leaks --models fuser.efficientnet_b0 --size 64 --device cpu   # a dry run

A CUDA-graph tree records a forward's allocations in a private pool and requires every tensor allocated
there to be an output or freed. A cache that keeps a tensor made on its first call (a plan built inside the
compiled forward, a converted copy) breaks that. This optimizes each model, compiles it with the "eager"
backend (dynamo only: the same fused-op calls, no CUDA graphs), runs it once, and lists each real tensor
alive afterwards that was not before, is not the output and is no module's parameter or buffer, with the
objects that hold it (two levels of ``gc.get_referrers``).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch


def _holders(obj: Any, depth: int, seen: set[int]) -> list[str]:
    out = []
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or type(ref).__name__ == "frame":
            continue
        seen.add(id(ref))
        label = type(ref).__name__
        if isinstance(ref, dict):
            label += "{" + ",".join(map(str, list(ref)[:4])) + "}"
        elif callable(ref):
            label += f"<{getattr(ref, '__qualname__', '')}>"
        out.append(label if depth == 0 else f"{label} <- [{'; '.join(_holders(ref, depth - 1, seen)[:3])}]")
    return out[:4]


def leaks(name: str, batch: int, size: int | None = None, device: str = "cuda") -> list[str]:
    from torch._subclasses import FakeTensor

    import fuser
    from benchmarks import real_models

    model, x = real_models.build(name, batch, size)
    model = model.to(device, memory_format=torch.channels_last)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        fused = fuser.optimize(model, (x,), backend="auto" if device == "cuda" else "interpret")
        compiled = torch.compile(fused, backend="eager")
        own = {id(t) for t in [*fused.parameters(), *fused.buffers()]}
        gc.collect()
        before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
        out = compiled(x)
        if device == "cuda":
            torch.cuda.synchronize()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    outputs = {id(t) for t in leaves}
    # A view's base is kept by the view itself (in C++, so gc names no holder): the storage is the output's.
    output_storages = {t.untyped_storage().data_ptr() for t in leaves}
    gc.collect()
    found = [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and o.device.type == device and not isinstance(o, FakeTensor)
        and id(o) not in before and id(o) not in outputs and id(o) not in own
        and o.untyped_storage().data_ptr() not in output_storages
    ]  # fmt: skip
    return [f"{tuple(t.shape)} {t.dtype}: held by {_holders(t, 1, {id(found)})}" for t in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="yolov8n,efficientnet_b0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, help="input size (default: each model's own)")
    parser.add_argument("--device", default="cuda", help="cpu: the kernels in Triton's interpreter (a dry run)")
    args = parser.parse_args()
    for name in args.models.split(","):
        found = leaks(name, args.batch, args.size, args.device)
        print(f"## {name}: {len(found)} tensors kept by the first compiled forward", flush=True)
        for line in found[:12]:
            print("  ", line[:400], flush=True)


if __name__ == "__main__":
    main()
