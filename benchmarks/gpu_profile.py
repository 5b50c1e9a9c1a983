"""Where a compress step's time goes on a GPU: its kernels, counted and timed by the profiler.

One ResNet-50-sized float32 gradient (the table of ``benchmarks.compress``), one method's
compress step through the core, after warm-up rounds (Triton compiles at the first). Prints
the step's wall time, the number of GPU kernels it launched, the sum of their run times (the
GPU busy; the rest of the wall time is launches and waits), and the kernels that took most.

    python -m benchmarks.gpu_profile [--method dgc] [--numel N] [--density D] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any, Dict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.compress import (DEFAULT_DENSITY, RESNET50_NUMEL, SEED, WARMUP, CompressStep,
                                 gradient)
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.torch.ops import TorchOps

TOP = 15


def profile_step(method_name: str, numel: int, density: float) -> Dict[str, Any]:
    """One profiled compress step of ``method_name`` on CUDA, after WARMUP unprofiled ones."""
    device = torch.device("cuda")
    step = CompressStep(TorchOps(), BY_NAME[method_name].build(), gradient(numel, SEED, device), density)
    for rep in range(WARMUP):
        step(rep)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step(WARMUP)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels: Dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.time_range.elapsed_us() / 1e3
    busy_ms = sum(total for _, total in kernels.values())
    top = sorted(kernels.items(), key=lambda item: -item[1][1])[:TOP]
    return {"method": method_name, "numel": numel, "density": density, "wall_ms": wall_ms,
            "kernels": sum(count for count, _ in kernels.values()), "gpu_busy_ms": busy_ms,
            "top": [{"kernel": name[:100], "count": count, "ms": ms} for name, (count, ms) in top],
            "device": torch.cuda.get_device_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", action="append", help="a method (repeatable; default: every method)")
    parser.add_argument("--numel", type=int, default=RESNET50_NUMEL)
    parser.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_profile needs a CUDA device")
    results = []
    for name in args.method or list(BY_NAME):
        result = profile_step(name, args.numel, args.density)
        results.append(result)
        print(f"{name}: {result['wall_ms']:.3f} ms wall, {result['kernels']} kernels, "
              f"{result['gpu_busy_ms']:.3f} ms of GPU work ({result['device']})")
        for row in result["top"]:
            print(f"    {row['ms']:8.3f} ms  {row['count']:4d} x  {row['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
