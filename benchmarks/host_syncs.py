"""Host synchronisations and time per training step of the PyTorch engine on a GPU.

For each method, ``--world`` engines (one per rank, in this process) take ResNet-50's 161
gradient tensors through ``--steps`` steps the way the fused path does: every tensor
compressed (or passed dense, below the method's ``min_numel``), the collectives emulated
(``core.collectives.emulate``: an allgather concatenates, an all-reduce averages), and every
rank decodes. Horovod is not needed.

A host synchronisation is any call that waits for the GPU (``.item()``, ``bool(t)``,
``.tolist()``, ``nonzero``, a copy to the host), counted with
``torch.cuda.set_sync_debug_mode("warn")``; each warning is attributed to the line of
``horovod_dgc`` that made it. Counts are per rank per step (steps after the first, whose
set-up is not a training step's), split into compress and decode.

Without a GPU, ``--device cpu`` runs the same steps on the CPU with the choices TorchOps
makes on a GPU (fixed sizes, compositions instead of the C kernels) and counts the host
reads made from Python (``bool(t)``, ``int(t)``, ``.item()``, ``.tolist()``, ``nonzero``):
at 864f4ce it gave the H200's measured waits exactly for dgc, scalecom and blocksign (161,
40 and 0 per rank in compress; 1,288, 966 and 323 in decode). It cannot see a wait inside a
framework op.

    python -m benchmarks.host_syncs [--methods dgc topk ...] [--world 4] [--steps 3]
                                    [--device cuda|cpu] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from benchmarks.compress import synchronize
from horovod_dgc.core.collectives import ALLREDUCE, cut_buckets, emulate
from horovod_dgc.core.methods import BY_NAME, METHODS
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.ops import TorchOps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from _resnet import resnet50  # noqa: E402

PACKAGE = str(ROOT / "horovod_dgc")
SYNC_WARNING = "synchronizing"


def caller_in_package() -> str:
    """``file:line`` of the innermost frame of horovod_dgc on the stack (the call that
    synchronised), or ``elsewhere``."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(PACKAGE):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno}"
    return "elsewhere"


class SyncCounter:
    """Counts the GPU synchronisations made while it is active, by the line that made them."""

    def __init__(self, device: torch.device) -> None:
        self.sites: collections.Counter = collections.Counter()
        self.device = device

    def __enter__(self) -> "SyncCounter":
        self._previous = warnings.showwarning
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._seen
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):
            self.sites[caller_in_package()] += 1
        else:
            self._previous(message, category, filename, lineno, file, line)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        warnings.showwarning = self._previous

    @property
    def total(self) -> int:
        return sum(self.sites.values())


# What reads a tensor's data on the host: on a GPU each of these waits for it.
HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero")


class HostReadCounter:
    """On the CPU, with the choices TorchOps makes on a GPU (``sizes_cost_a_wait``, set while
    it is active), counts
    the calls that read tensor data on the host (``HOST_READS``, and ``torch.nonzero``), by
    the line of horovod_dgc that made them: what the GPU's waits would be, without a GPU.
    It sees only reads made from Python; a framework op that waits inside (boolean-mask
    indexing, say) is not counted, which is why the GPU's count is the measurement."""

    def __init__(self) -> None:
        self.sites: collections.Counter = collections.Counter()
        self._saved: List[Tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.sites[caller_in_package()] += 1
            return original(*args, **kwargs)

        # An inherited method (Tensor's from its C base) is removed again, not overwritten.
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, counted)

    def __enter__(self) -> "HostReadCounter":
        self._saved.append((TorchOps, "sizes_cost_a_wait", TorchOps.__dict__["sizes_cost_a_wait"]))
        TorchOps.sizes_cost_a_wait = lambda ops, x: True  # the GPU's choices
        for name in HOST_READS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "nonzero")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def counter(device: torch.device):
    """The waits' counter for ``device``: GPU synchronisations, or host reads on the CPU."""
    return SyncCounter(device) if device.type == "cuda" else HostReadCounter()


def gradients(shapes: Sequence[Tuple[int, ...]], world: int, step: int, device: torch.device,
              dtype: torch.dtype = torch.float32) -> List[List[torch.Tensor]]:
    """Each rank's gradients (``[rank][tensor]``), drawn on the CPU from a seed of the step
    and rank (the same values on every device)."""
    generators = [torch.Generator().manual_seed(step * world + rank) for rank in range(world)]
    return [[torch.randn(shape, generator=g).to(device=device, dtype=dtype) for shape in shapes]
            for g in generators]


def compress_all(engines: Sequence[Engine], names: Sequence[str],
                 grads: Sequence[Sequence[torch.Tensor]]) -> List[Any]:
    """Every rank's stage-1 output for every tensor (``grads[rank][tensor]``), by tensor:
    ("sparse", message), ("two-stage", (message, handover)) or ("dense", update)."""
    outputs = []
    for i, name in enumerate(names):
        per_rank = []
        for engine, rank_grads in zip(engines, grads):
            grad = rank_grads[i]
            if not engine.compresses(grad):
                per_rank.append(("dense", engine.dense(name, grad, None)))
            elif engine.method.family == "two-stage":
                per_rank.append(("two-stage", engine.first(name, grad, None)))
            else:
                per_rank.append(("sparse", engine.compress(name, grad, None)))
        outputs.append(per_rank)
    return outputs


def decode_all(engines: Sequence[Engine], names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
               outputs: Sequence[Any]) -> List[List[torch.Tensor]]:
    """Every rank's averaged gradient of every tensor (``[rank][tensor]``), from the
    emulated collectives."""
    averages: List[List[torch.Tensor]] = [[] for _ in engines]
    for name, shape, per_rank in zip(names, shapes, outputs):
        kind = per_rank[0][0]
        if kind == "dense":
            reduced = emulate(engines[0].ops, ALLREDUCE, [sent.tensor for _, sent in per_rank])
            results = [engine.dense_received(sent, r)
                       for engine, (_, sent), r in zip(engines, per_rank, reduced)]
        elif kind == "sparse":
            gathered = torch.cat([outgoing.message for _, outgoing in per_rank])
            results = [engine.decompress(gathered, [outgoing])[0]
                       for engine, (_, outgoing) in zip(engines, per_rank)]
        else:
            firsts = [first for _, first in per_rank]
            results = [engine.finish(final, handover, torch.Size(shape))
                       for engine, (_, handover), final in zip(engines, firsts, two_stages(engines, name, firsts))]
        for rank, result in enumerate(results):
            averages[rank].append(result)
    return averages


def two_stages(engines: Sequence[Engine], name: str, firsts: Sequence[Tuple[torch.Tensor, Any]]) -> List[torch.Tensor]:
    """What a two-stage method's SECOND collective delivers to each rank for ``name`` (a
    tensor, or a bucket's key), from every rank's stage 1 (message, handover), both
    collectives emulated."""
    ops, method = engines[0].ops, engines[0].method
    root = method.root(firsts[0][1].call)
    received = emulate(ops, method.FIRST, [message for message, _ in firsts], root, firsts[0][1].chunks)
    seconds = [engine.second(name, r, handover) for engine, (_, handover), r in zip(engines, firsts, received)]
    return emulate(ops, method.SECOND, seconds, root)


def decode_buckets(engines: Sequence[Engine], outputs: Sequence[Any], shapes: Sequence[Tuple[int, ...]],
                   bucket_bytes: float) -> None:
    """Every rank's decode of sparse messages (``outputs`` of :func:`compress_all`, all of
    kind "sparse") as the fused optimizer decodes them: those of consecutive tensors of about
    ``bucket_bytes`` of float32 gradient together, one call per bucket and rank."""
    for bucket in cut_buckets([4 * math.prod(shape) for shape in shapes], bucket_bytes):
        gathered = torch.cat([outputs[i][r][1].message for r in range(len(engines)) for i in bucket])
        for rank, engine in enumerate(engines):
            engine.decompress(gathered, [outputs[i][rank][1] for i in bucket])


def measure(name: str, options: Dict[str, Any], shapes: Sequence[Tuple[int, ...]], world: int,
            steps: int, device: torch.device) -> Dict[str, Any]:
    engines = [Engine(BY_NAME[name].build(**options), world_size=world, rank=r) for r in range(world)]
    names = [f"t{i}" for i in range(len(shapes))]
    result: Dict[str, Any] = {"method": name, "options": options, "world": world, "steps": []}
    for step in range(steps):
        grads = gradients(shapes, world, step, device)
        synchronize(device)
        started = time.perf_counter()
        with counter(device) as compress:
            outputs = compress_all(engines, names, grads)
        with counter(device) as decode:
            decode_all(engines, names, shapes, outputs)
        synchronize(device)
        result["steps"].append({
            "compress_syncs_per_rank": compress.total / world,
            "decode_syncs_per_rank": decode.total / world,
            "time_per_rank_ms": (time.perf_counter() - started) * 1e3 / world,
            "sites": dict((compress.sites + decode.sites).most_common(12))})
    return result


def print_result(result: Dict[str, Any]) -> None:
    label = result["method"] + "".join(f" {k}={v}" for k, v in result["options"].items())
    for i, step in enumerate(result["steps"]):
        print(f"{label:<34} step {i}: {step['compress_syncs_per_rank']:7.1f} syncs in compress, "
              f"{step['decode_syncs_per_rank']:7.1f} in decode per rank; "
              f"{step['time_per_rank_ms']:8.1f} ms per rank")
    print("  where (last step, all ranks):")
    for site, count in result["steps"][-1]["sites"].items():
        print(f"    {count:6d}  {site}")


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=[spec.name for spec in METHODS],
                   choices=[spec.name for spec in METHODS])
    p.add_argument("--sparse-allreduce", action="store_true",
                   help="also dgc with aggregation='sparse_allreduce'")
    p.add_argument("--world", type=int, default=4, help="ranks emulated in this process")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", type=torch.device, default=torch.device("cuda"),
                   help="cuda: GPU synchronisations; cpu: host reads with the GPU's choices")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] = None) -> None:
    args = parse_args(argv)
    device = args.device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_syncs counts GPU synchronisations: no CUDA device here")
    shapes = [tuple(p.shape) for p in resnet50().parameters()]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else "CPU with the GPU's choices, host reads counted")
    print(f"{where}, torch {torch.__version__}; ResNet-50's "
          f"{len(shapes)} tensors, {args.world} ranks emulated, {args.steps} steps\n")
    runs = [(name, {}) for name in args.methods]
    if args.sparse_allreduce:
        runs.append(("dgc", {"aggregation": "sparse_allreduce"}))
    results = []
    for name, options in runs:
        results.append(measure(name, options, shapes, args.world, args.steps, device))
        print_result(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
