"""What compression costs per rank per step on a whole model's tensors, against one tensor of
the same total size: the fixed cost per tensor that a single large gradient (``make
bench-compress``) does not show.

Each method takes ResNet-50's 161 gradient tensors through three layouts, with ``--world``
ranks emulated in this process (the collectives emulated: ``benchmarks.host_syncs``), on the
CPU, one thread (or on ``--device cuda``):

* **per tensor**: every tensor compressed and decoded on its own (the per-tensor path, which
  every bucket's tensors must match);
* **buckets**: buckets of about 25 MB of gradient in reverse order, as both Horovod paths
  cut them, each compressed as one (``Engine.compress_bucket``, ``Engine.first_bucket``) where
  the method is ``bucketed`` (dgc, topk, gaussiank, scalecom, and ``dgc-sar``: dgc with
  ``aggregation="sparse_allreduce"``), else tensor by tensor and decoded in one call per
  bucket;
* **one tensor**: a single tensor of the same 25,557,032 entries, shaped ``(25557032, 1)`` so
  that it is compressed as a large tensor (a 1-D one would count as small).

Tensors the method does not compress (blocksign's norms and biases, ``min_numel``) go dense:
all-reduced tensor by tensor in the per-tensor and one-tensor layouts, as the stock path
sends them, and in the buckets layout as one flat tensor received at once, as the fused
optimizer's dense bucket.

For each it prints the milliseconds of compress and decode per rank per step (medians,
layouts interleaved in every round), and, from separate steps, the ATen operations dispatched
per rank per step (what a GPU launches, views included; a Triton kernel counts as one) and
the waits for the device: on the CPU with the choices TorchOps makes on a GPU (fixed sizes,
no C kernels; the GPU's Triton kernels run by Triton's interpreter when the process starts
with ``TRITON_INTERPRET=1``, as ``make bench-model-step`` starts it) and the host reads
that would wait for it (``host_syncs.HostReadCounter``); on a GPU the synchronisations
themselves (``host_syncs.SyncCounter``)::

    TRITON_INTERPRET=1 python -m benchmarks.model_step [--methods dgc topk dgc-sar ...] [--world 2] [--rounds 5]
        [--split 10] [--layouts buckets ...] [--device cpu|cuda]

``--rounds 0`` counts without timing (milliseconds shown as "-").
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.compress import synchronize
from benchmarks.host_syncs import compress_all, counter, decode_all, decode_buckets, resnet50, two_stages
from horovod_dgc.core.collectives import ALLREDUCE, DEFAULT_BUCKET_CAP_MB, cut_buckets, emulate
from horovod_dgc.core.methods import BY_NAME, METHODS
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.kernels import triton_bits, triton_memory

LAYOUTS = ("per tensor", "buckets", "one tensor")
# Methods with other than their default options: name -> (method, options).
VARIANTS = {"dgc-sar": ("dgc", {"aggregation": "sparse_allreduce"})}
CHOICES = [spec.name for spec in METHODS] + list(VARIANTS)


def build(name: str):
    """The core method of a method's or a variant's name."""
    method, options = VARIANTS.get(name, (name, {}))
    return BY_NAME[method].build(**options)


def triton_launchers() -> List[type]:
    """The classes whose ``run`` launches a Triton kernel: the compiled one's, and the
    interpreter's (which runs the GPU's kernels on CPU tensors in a process started with
    ``TRITON_INTERPRET=1``, as ``make bench-model-step`` and ``bench-optimizer-step`` start
    theirs); none without Triton."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [JITFunction, InterpretedFunction]


def kernels_counted(device: torch.device) -> str:
    """How a count on ``device`` took the GPU's Triton kernels, in words."""
    if device.type == "cuda" or triton_memory.INTERPRETED:
        return "Triton kernels launched" + (" (interpreted on the CPU)" if device.type != "cuda" else "")
    return "no Triton kernels (their compositions instead: start with TRITON_INTERPRET=1 to count them)"


def large_interpreted_programs() -> None:
    """Under Triton's interpreter, programs of about 65,536 entries: it pays per program, and
    a launch counts once whatever its grid."""
    if triton_memory.INTERPRETED:
        triton_memory.ENTRIES_PER_PROGRAM = triton_bits.BYTES_PER_PROGRAM = 2 ** 16
        triton_bits.POSITIONS_PER_PROGRAM = triton_bits.BITS_PER_STEP = 2 ** 16


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active, and each Triton kernel
    launched as one (what the interpreter dispatches inside a launch is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._launching = 0
        self._saved: List[Tuple[type, Any]] = []

    def __enter__(self) -> "OpCounter":
        for launcher in triton_launchers():
            original = launcher.run

            def run(kernel, *args, _original=original, **kwargs):
                self.count += 1
                self._launching += 1
                try:
                    return _original(kernel, *args, **kwargs)
                finally:
                    self._launching -= 1

            self._saved.append((launcher, original))
            launcher.run = run
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for launcher, original in self._saved:
            launcher.run = original
        self._saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._launching:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Run:
    """One method's engines on one layout, stepped on demand."""

    def __init__(self, method: str, shapes: Sequence[Tuple[int, ...]], layout: str, world: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.engines = [Engine(build(method), world_size=world, rank=r) for r in range(world)]
        self.layout, self.device = layout, device
        self.shapes = [(sum(math.prod(s) for s in shapes), 1)] if layout == "one tensor" else list(shapes)
        self.names = [f"t{i}" for i in range(len(self.shapes))]
        self.gen = torch.Generator().manual_seed(0)
        config = self.engines[0].config
        # Both Horovod paths' order (backward's), compressed tensors only.
        order = [i for i in reversed(range(len(self.shapes))) if config.compresses(self.shapes[i], "float32")]
        self.dense = [i for i in range(len(self.shapes)) if i not in order]
        sizes = [4 * math.prod(self.shapes[i]) for i in order]
        self.buckets = [[order[i] for i in bucket] for bucket in cut_buckets(sizes, DEFAULT_BUCKET_CAP_MB * 2 ** 20)]

    def gradients(self) -> List[List[torch.Tensor]]:
        """Fresh gradients of every rank (``[rank][tensor]``)."""
        return [[torch.randn(s, generator=self.gen).to(self.device) for s in self.shapes] for _ in self.engines]

    def step(self, grads: List[List[torch.Tensor]]) -> None:
        """One step of every rank: compress, the emulated exchange, decode."""
        if self.layout == "buckets" and self.engines[0].method.bucketed:
            self._bucketed_step(grads)
            return
        outputs = compress_all(self.engines, self.names, grads)
        if self.layout == "buckets" and self.engines[0].method.family == "sparse":
            for bucket in self.buckets:
                decode_buckets(self.engines, [outputs[i] for i in bucket], [self.shapes[i] for i in bucket],
                               float("inf"))
            self._dense_step(grads)
        else:
            decode_all(self.engines, self.names, self.shapes, outputs)

    def _dense_step(self, grads: List[List[torch.Tensor]]) -> None:
        """The tensors the method does not compress, as the fused optimizer's dense bucket
        sends them (``Engine.dense_all``: one flat tensor per dtype), all-reduced and received."""
        if not self.dense:
            return
        sent = [engine.dense_all("dense", [(self.names[i], rank_grads[i], None) for i in self.dense])
                for engine, rank_grads in zip(self.engines, grads)]
        for j in range(len(sent[0])):
            reduced = emulate(self.engines[0].ops, ALLREDUCE, [rank_sent[j][0].tensor for rank_sent in sent])
            for engine, rank_sent, averaged in zip(self.engines, sent, reduced):
                engine.dense_all_received(rank_sent[j][0], averaged)

    def _bucketed_step(self, grads: List[List[torch.Tensor]]) -> None:
        """Every bucket compressed, then every bucket decoded, as a training step runs them
        (a step's checks are then read once, when its last bucket comes back)."""
        sent, two_stage = [], self.engines[0].method.family == "two-stage"
        for members in self.buckets:
            sent.append([])
            for engine, rank_grads in zip(self.engines, grads):
                bucket = engine.bucket(f"b{members[0]}", [(self.names[i], rank_grads[i]) for i in members])
                start = engine.first_bucket if two_stage else engine.compress_bucket
                sent[-1].append((bucket, start(bucket, [rank_grads[i] for i in members], [None] * len(members)),
                                 [rank_grads[i].shape for i in members]))
        for per_rank in sent:
            if two_stage:
                self._two_stages(per_rank)
                continue
            gathered = torch.cat([o.message for _, o, _ in per_rank])
            for engine, (_, outgoing, _) in zip(self.engines, per_rank):
                engine.decompress(gathered, [outgoing])
        self._dense_step(grads)

    def _two_stages(self, per_rank: List[Any]) -> None:
        """A bucket's two collectives, emulated, and every rank's update."""
        finals = two_stages(self.engines, per_rank[0][0].key, [first for _, first, _ in per_rank])
        for engine, (bucket, (_, handover), shapes), final in zip(self.engines, per_rank, finals):
            engine.finish_bucket(final, handover, bucket, shapes)


def timed(run: Run, world: int) -> float:
    """Seconds per rank of one step."""
    grads = run.gradients()
    synchronize(run.device)
    started = time.perf_counter()
    run.step(grads)
    synchronize(run.device)
    return (time.perf_counter() - started) / world


def counted(run: Run, world: int) -> Tuple[float, float]:
    """(ATen operations, waits for the device) per rank of one step (on the CPU with a GPU's
    choices)."""
    grads = run.gradients()
    with counter(run.device) as waits, OpCounter() as ops:
        run.step(grads)
    return ops.count / world, waits.total / world


def split_shapes(shapes: Sequence[Tuple[int, ...]], pieces: int) -> List[Tuple[int, ...]]:
    """Each tensor cut along its first dimension into ``pieces`` of near-equal sizes (as many
    entries in all, each piece of its tensor's rank, so as small or large as its tensor): a
    model of ``pieces`` times the tensors and the same total size."""
    cut = []
    for first, *rest in shapes:
        if first < pieces:
            raise ValueError(f"a tensor of shape {(first, *rest)} has fewer than {pieces} rows")
        cut += [((i + 1) * first // pieces - i * first // pieces, *rest) for i in range(pieces)]
    return cut


def measure(methods: Sequence[str], world: int, warmup: int, rounds: int, pieces: int = 1,
            device: torch.device = torch.device("cpu"),
            layouts: Sequence[str] = LAYOUTS) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per method and layout: "ms" (the median of ``rounds`` timed steps, NaN for none),
    "ops" and "reads" (counted on a fresh run's second step)."""
    shapes = [tuple(p.shape) for p in resnet50().parameters()]
    if pieces > 1:
        shapes = split_shapes(shapes, pieces)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for method in methods:
        times: Dict[str, List[float]] = {layout: [] for layout in layouts}
        if rounds:
            runs = {layout: Run(method, shapes, layout, world, device) for layout in layouts}
            for run in runs.values():
                for _ in range(warmup):
                    run.step(run.gradients())
            for r in range(rounds):
                for layout in (layouts if r % 2 == 0 else tuple(reversed(layouts))):
                    times[layout].append(timed(runs[layout], world))
        results[method] = {}
        for layout in layouts:
            counting = Run(method, shapes, layout, world, device)
            counting.step(counting.gradients())  # the first makes the plans' tables and layouts
            aten, reads = counted(counting, world)
            ms = statistics.median(times[layout]) * 1e3 if times[layout] else math.nan
            results[method][layout] = {"ms": ms, "ops": aten, "reads": reads}
    return results


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=CHOICES, choices=CHOICES)
    p.add_argument("--world", type=int, default=2, help="ranks emulated in this process")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed steps per layout (candidate bounds settle within about 15 steps of randn gradients)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per layout, interleaved (0: count only)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--split", type=int, default=1,
                   help="cut each tensor into this many (10: 1,610 tensors of the same total size)")
    p.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    return p.parse_args(argv)


def main(argv: Sequence[str] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    large_interpreted_programs()
    results = measure(args.methods, args.world, args.warmup, args.rounds, args.split, args.device, args.layouts)
    model = "ResNet-50's 161 tensors" + (f", each cut into {args.split}" if args.split > 1 else "")
    where = (torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "CPU, one thread")
    print(f"{model} (25,557,032 entries), {args.world} ranks emulated, {where}, "
          f"torch {torch.__version__}; compress + decode per rank per step, median of {args.rounds}; "
          f"operations counted with {kernels_counted(args.device)}, each one operation\n")
    waits = "synchronisations" if args.device.type == "cuda" else "host reads"
    print(f"| method | layout | ms | x one tensor | ATen ops | {waits} |")
    print("|---|---|---:|---:|---:|---:|")
    for method, layouts in results.items():
        flat = layouts.get("one tensor", {"ms": math.nan})["ms"]
        for layout, r in layouts.items():
            print(f"| {method} | {layout} | {_shown(r['ms'], '.1f')} | {_shown(r['ms'] / flat, '.2f')} | "
                  f"{r['ops']:.0f} | {r['reads']:.0f} |")


def _shown(x: float, spec: str) -> str:
    """``x`` formatted, or "-" where it was not measured."""
    return "-" if math.isnan(x) else format(x, spec)


if __name__ == "__main__":
    main()
