"""Where a compress step's time goes on a GPU: its kernels, counted and timed by the profiler.

One ResNet-50-sized float32 gradient (the table of ``benchmarks.compress``), one method's
compress step through the core as the engine runs it on a GPU (checks deferred), after
warm-up rounds (Triton compiles at the first). Prints the number of GPU kernels the step
launched, the sum of their run times (the GPU busy), the step's wall time (the rest of it is
launching), and the kernels that took most.

    python -m benchmarks.gpu_profile [--method dgc] [--numel N] [--density D] [--graph] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
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
GRAPH_REPLAYS = 11


def replayed_ms(step: CompressStep) -> Dict[str, Any]:
    """Median milliseconds of GRAPH_REPLAYS replays of ``step`` captured in a CUDA graph, or
    why it could not be captured."""
    step.spare = None  # the captured step's new memories come from the graph's own pool
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(0)  # on the capture's stream first, as CUDA graphs ask
        torch.cuda.current_stream().wait_stream(side)
        step.spare = None
        with torch.cuda.graph(graph):
            step(1)
        step.ops.discard_checks()
    except Exception as error:  # noqa: BLE001 (a measurement: report why, go on)
        return {"graph_error": f"{type(error).__name__}: {str(error)[:300]}"}
    times = []
    for _ in range(WARMUP + GRAPH_REPLAYS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"graph_replay_ms": statistics.median(times[WARMUP:])}


def profile_step(method_name: str, numel: int, density: float, graph: bool) -> Dict[str, Any]:
    """One profiled compress step of ``method_name`` on CUDA, after WARMUP unprofiled ones, with
    the engine's TorchOps on a GPU (checks deferred to the step's end, so a compress step reads
    nothing back); the median wall time of unprofiled steps; and with ``graph``,
    :func:`replayed_ms`."""
    device = torch.device("cuda")
    ops = TorchOps(defer_checks=True)
    step = CompressStep(ops, BY_NAME[method_name].build(), gradient(numel, SEED, device), density)

    def timed(rep: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(rep)
        torch.cuda.synchronize()
        ops.discard_checks()  # a benchmark's steps are not settled: nothing to raise
        return (time.perf_counter() - start) * 1e3

    for rep in range(WARMUP):
        timed(rep)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(WARMUP)
    kernels: Dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.time_range.elapsed_us() / 1e3
    busy_ms = sum(total for _, total in kernels.values())
    top = sorted(kernels.items(), key=lambda item: -item[1][1])[:TOP]
    wall_ms = statistics.median(timed(WARMUP + 1 + rep) for rep in range(GRAPH_REPLAYS))
    read_ms = statistics.median(time_read_pass(step.grad) for _ in range(GRAPH_REPLAYS))
    return {"method": method_name, "numel": numel, "density": density, "wall_ms": wall_ms,
            "kernels": sum(count for count, _ in kernels.values()), "gpu_busy_ms": busy_ms,
            "read_pass_ms": read_ms,
            "top": [{"kernel": name[:100], "count": count, "ms": ms} for name, (count, ms) in top],
            "device": torch.cuda.get_device_name(), **(replayed_ms(step) if graph else {})}


def time_read_pass(x: torch.Tensor) -> float:
    """Milliseconds of one ``x.sum()``, the unit of ``benchmarks.compress``'s read passes."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    x.sum()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", action="append", help="a method (repeatable; default: every method)")
    parser.add_argument("--numel", type=int, default=RESNET50_NUMEL)
    parser.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    parser.add_argument("--graph", action="store_true",
                        help="also replay each step as a captured CUDA graph")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_profile needs a CUDA device")
    results = []
    for name in args.method or list(BY_NAME):
        result = profile_step(name, args.numel, args.density, args.graph)
        results.append(result)
        read = result["read_pass_ms"]
        print(f"{name}: {result['kernels']} kernels, {result['gpu_busy_ms']:.3f} ms of GPU work = "
              f"{result['gpu_busy_ms'] / read:.1f} read passes of {read:.3f} ms; the step "
              f"{result['wall_ms']:.3f} ms = {result['wall_ms'] / read:.1f} read passes "
              f"(median of {GRAPH_REPLAYS}; {result['device']})")
        if "graph_replay_ms" in result:
            print(f"    replayed as a CUDA graph: {result['graph_replay_ms']:.3f} ms = "
                  f"{result['graph_replay_ms'] / read:.1f} read passes")
        elif "graph_error" in result:
            print(f"    not captured as a CUDA graph: {result['graph_error']}")
        for row in result["top"]:
            print(f"    {row['ms']:8.3f} ms  {row['count']:4d} x  {row['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
