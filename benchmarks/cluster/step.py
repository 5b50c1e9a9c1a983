"""Training-step benchmark on a cluster: step time, images/s and bytes on the wire per method.

Run by every worker of a cluster, one or more per host (``python -m horovod_dgc.cluster
worker -- python benchmarks/cluster/step.py``; ``python -m benchmarks.cluster.run`` does it
on network namespaces, ``docker/docker-compose.yml`` on containers)::

    python benchmarks/cluster/step.py [--methods dense,dgc,...] [--model resnet50|tiny]
        [--batch-size 32] [--image-size 32] [--warmup-steps 2] [--steps 5]
        [--link NAME] [--interleave] [--out results.jsonl]

Every method trains the same model (same initial weights on every rank, synthetic data of
``--image-size`` pixels: small images keep the compute modest while the gradient keeps
ResNet-50's 25,557,032 parameters) for ``--warmup-steps`` untimed steps, then
``--steps`` timed ones. Methods, all from the same SGD (lr 0.01, momentum 0.9):

* ``dense``, ``fp16``: the stock ``hvd.DistributedOptimizer`` with Horovod's own compression;
* ``dgc``, ``topk``, ``gaussiank``, ``scalecom``, ``blocksign``: ``horovod_dgc.torch``'s own
  ``DistributedOptimizer`` (fused buckets) with each method's default settings;
* ``dgc-sar``, ``dgc-hier``: dgc with ``aggregation="sparse_allreduce"``, or with
  ``hierarchical=True`` (averaged inside each host, compressed between hosts only; it needs
  several workers per host, so it runs only when ``--methods`` names it);
* ``dgc-ddp``: dgc as a PyTorch DDP communication hook (``horovod_dgc.torch.ddp``, DDP's
  default buckets, no buffer broadcast at each forward) over Gloo, on a process group set up
  beside Horovod;
* ``powersgd``: the outside reference, PyTorch DDP over Gloo with the PowerSGD communication
  hook (``--powersgd-rank``, one gradient bucket), on the same process group.

With ``--interleave`` every method is built first and warmed up in turn, then the timed steps
alternate between the methods (one step of each per round, the order turned by one each
round, every rank at a barrier before each step): each method's steps meet the same moments
of a shared machine, so their medians compare pair by pair, where methods timed one after
another (or in launches of their own) also differ by what the machine did meanwhile. Horovod
then negotiates every cycle over the names of all of them (see ``run.py``).

Per method, rank 0 prints and (``--out``) appends one JSON line: the median over the timed
steps of the slowest worker's step time, images/s of the whole cluster, and the bytes each
worker sent per step, read from its interface's ``tx_bytes`` counter (the interface Gloo
uses, ``HOROVOD_GLOO_IFACE``) before and after the timed steps (with several workers on a
host: the host's bytes divided among them; traffic inside a host never reaches the link),
next to what the library says it should be: the bytes handed to the collectives (Horovod's,
or torch.distributed's for ``dgc-ddp``) and the bytes they send on the network, per worker per
step (``stats()`` for our methods; for Horovod's own the ring all-reduce of the float32 or
float16 gradient, ``collectives.network_bytes``; none for PowerSGD).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import socket
import sys
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_dgc.torch as hdgc
from horovod_dgc.torch import ddp as dgc_ddp
from horovod_dgc.core.adaptive import Adaptive
from horovod_dgc.core.collectives import ALLREDUCE, network_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from _resnet import resnet50  # noqa: E402

LR = 0.01
MOMENTUM = 0.9
SEED = 0
RESNET_CLASSES = 1000
TINY_CLASSES = 10
IDLE_S = 2.0
POWERSGD_START_ITER = 2  # PowerSGD's smallest start with error feedback; earlier steps go dense
TORCH_DIST_TIMEOUT_S = 120
SPARSE_METHODS = ("dgc", "topk", "gaussiank", "scalecom", "blocksign")
# Our methods with other than their default options: (method, options, setting label).

def adaptive_for(warmup_steps: int) -> Adaptive:
    """dgc-adaptive's settings: decided after the last warm-up step from the ones before it
    but the first (its one-off costs), or with 2 warm-up steps after the first timed step
    from the second warm-up step."""
    first = max(2, warmup_steps - 1)
    return Adaptive(first_decision_step=first, sample_steps=min(3, first - 1))


VARIANTS = {"dgc-sar": ("dgc", {"aggregation": "sparse_allreduce"}, "sparse all-reduce"),
            "dgc-hier": ("dgc", {"hierarchical": True}, "between hosts only"),
            "dgc-adaptive": ("dgc", {"adaptive": True}, "adaptive")}
# Options of a compressor that are not its method's (the traffic model builds methods only).
COMPRESSOR_OPTIONS = ("hierarchical", "adaptive")
METHODS = ("dense", "fp16", *SPARSE_METHODS, *VARIANTS, "dgc-ddp", "powersgd")
HOST_METHODS = ("dgc-hier",)  # need several workers per host: never run by default
DEFAULT_METHODS = tuple(m for m in METHODS if m not in HOST_METHODS)

Step = Callable[[], None]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {','.join(METHODS)} (default: all but "
                        f"{','.join(HOST_METHODS)}, which needs several workers per host)")
    p.add_argument("--model", choices=("resnet50", "tiny"), default="resnet50",
                   help="tiny: a 3-layer CNN for smoke tests")
    p.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    p.add_argument("--image-size", type=int, default=32, help="pixels per side")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per method")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="PowerSGD's matrix_approximation_rank")
    p.add_argument("--link", default="unknown", help="label of the network, for the records")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the methods' timed steps (after every method's warm-up)")
    p.add_argument("--iface", default=os.environ.get("HOROVOD_GLOO_IFACE"),
                   help="interface whose tx_bytes are read (default: HOROVOD_GLOO_IFACE)")
    p.add_argument("--out", type=Path, help="rank 0 appends one JSON line per method here")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    for name in ("batch_size", "image_size", "steps", "powersgd_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if not args.iface:
        p.error("--iface is not given and HOROVOD_GLOO_IFACE is not set")
    return args


@dataclass(frozen=True)
class Record:
    """One method's result on one link (what rank 0 writes); ``step_s``: the slowest
    worker's time of each timed step."""

    link: str
    method: str
    optimizer: str
    setting: str
    workers: int
    model: str
    params: int
    batch_size: int
    image_size: int
    warmup_steps: int
    steps: int
    median_step_s: float
    images_per_s: float
    tx_bytes_per_step: float
    tx_bytes_per_step_max: float
    handed_bytes_per_step: Optional[float]
    estimated_bytes_per_step: Optional[float]
    idle_bytes_per_s: float
    step_s: Tuple[float, ...]
    workers_per_host: int = 1
    buckets: Tuple[str, ...] = ()  # with adaptive=, each bucket's mode and why
    interleaved: bool = False  # timed in rounds with the launch's other methods


class TinyNet(nn.Module):
    """Three small layers, two of them large enough (>= 1024 elements) to be compressed."""

    def __init__(self, classes: int = TINY_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(64 * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(name: str) -> Tuple[nn.Module, int]:
    """The model, with the same initial weights on every rank, and its number of classes."""
    torch.manual_seed(SEED)
    if name == "resnet50":
        return resnet50(num_classes=RESNET_CLASSES), RESNET_CLASSES
    return TinyNet(), TINY_CLASSES


def tx_bytes(iface: str, counter: str = "tx_bytes") -> int:
    """What this host's ``iface`` has sent so far: the kernel's ``counter`` (bytes, or
    ``tx_packets``)."""
    return int(Path(f"/sys/class/net/{iface}/statistics/{counter}").read_text())


def interface_address(iface: str) -> str:
    import psutil

    for address in psutil.net_if_addrs().get(iface, []):
        if address.family == socket.AF_INET:
            return address.address
    raise RuntimeError(f"rank {hvd.rank()}: interface {iface} has no IPv4 address")


def init_torch_distributed(iface: str) -> None:
    """A Gloo process group for DDP, its store on rank 0's address (shared through Horovod)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    endpoint = None
    if hvd.rank() == 0:
        address = interface_address(iface)
        with socket.socket() as probe:
            probe.bind((address, 0))
            endpoint = (address, probe.getsockname()[1])
    address, port = hvd.broadcast_object(endpoint, root_rank=0, name="cluster_step.store")
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=hvd.rank(),
                            world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=TORCH_DIST_TIMEOUT_S))


def parameters_digest(model: nn.Module) -> str:
    """The SHA-256 of every parameter's bytes: equal on every rank that holds the same model."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def build_method(method: str, model: nn.Module, args: argparse.Namespace
                 ) -> Tuple[nn.Module, torch.optim.Optimizer, str, str, object]:
    """(module to call, optimizer, optimizer label, setting label, our compression or None)
    for ``method``."""
    if method in ("dense", "fp16"):
        compression = hvd.Compression.none if method == "dense" else hvd.Compression.fp16
        optimizer = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                             compression=compression)
        return (model, optimizer, "hvd.DistributedOptimizer",
                "float32" if method == "dense" else "float16", None)
    if method in SPARSE_METHODS or method in VARIANTS:
        name, options, variant = VARIANTS.get(method, (method, {}, ""))
        if options.get("adaptive"):
            options = {**options, "adaptive": adaptive_for(args.warmup_steps)}
        compression = getattr(hdgc.Compression, name)(**options)
        optimizer = hdgc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                              compression=compression)
        density = getattr(compression.config, "density", None)
        setting = f"density {density:g}" if density is not None else "1-bit signs"
        setting += f", {variant}" if variant else ""
        return model, optimizer, "horovod_dgc.torch.DistributedOptimizer", setting, compression
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    init_torch_distributed(args.iface)
    if method == "dgc-ddp":
        compression = hdgc.Compression.dgc(momentum=MOMENTUM)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)  # momentum in dgc
        # No buffer broadcast each forward (ResNet-50's norms: 212 kB from rank 0): no other
        # method here sends buffers, and stats() counts gradients only.
        ddp = DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False)
        dgc_ddp.register(ddp, compression, optimizer=optimizer)
        return (ddp, optimizer, "torch DDP (Gloo) + horovod_dgc hook",
                f"density {compression.config.density:g}", compression)
    # One bucket: PowerSGD issues each bucket's later collectives from completion callbacks, so
    # with several buckets Gloo ranks can issue them in different orders (a collective mismatch).
    gradient_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    ddp = DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False,
                                  bucket_cap_mb=math.ceil(gradient_mb) + 1)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                   start_powerSGD_iter=POWERSGD_START_ITER)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return (ddp, sgd(ddp), "torch DDP (Gloo) + PowerSGD hook", f"rank {args.powersgd_rank}",
            None)


def estimate(method: str, model: nn.Module, compression: object, timed_steps: int
             ) -> Tuple[Optional[float], Optional[float]]:
    """(bytes handed to Horovod, bytes sent on the network) per worker per timed step, as
    the library models them; (None, None) where it has no model (PowerSGD)."""
    if compression is not None:
        stats = compression.stats()
        # A hierarchical compressor's statistics are its host's, shared by its workers.
        shared_by = hvd.local_size() if getattr(compression, "hierarchical", False) else 1
        return (stats.bytes_sent / timed_steps / shared_by,
                stats.network_bytes / timed_steps / shared_by)
    if method not in ("dense", "fp16"):
        return None, None
    handed = sum(p.numel() for p in model.parameters()) * (4 if method == "dense" else 2)
    return float(handed), network_bytes(ALLREDUCE, handed, hvd.size())


def per_worker_of_hosts(value: float, name: str) -> List[float]:
    """A host-wide reading (the interface's counter) of every host, divided among the host's
    workers: one entry per host, from its local rank 0."""
    readings = hvd.allgather_object((hvd.local_rank(), value), name=name)
    return [v / hvd.local_size() for local_rank, v in readings if local_rank == 0]


def idle_per_s(iface: str, seconds: float = IDLE_S,
               counters: Sequence[str] = ("tx_bytes",)) -> List[float]:
    """Per counter of :func:`tx_bytes`, what this host sends per second while no worker trains:
    Horovod's background loop negotiating every ``HOROVOD_CYCLE_TIME`` (part of every step's
    interface bytes, in no library's estimate)."""
    hvd.barrier()
    before, started = [tx_bytes(iface, c) for c in counters], time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return [(tx_bytes(iface, c) - b) / elapsed for c, b in zip(counters, before)]


def time_steps(step: Step, warmup_steps: int, steps: int, iface: str,
               reset_counters: Callable[[], None]) -> Tuple[List[float], int]:
    """Run the warm-up, then the timed steps: (seconds per step, bytes sent meanwhile);
    ``reset_counters`` runs between the two."""
    for _ in range(warmup_steps):
        step()
    hvd.barrier()
    reset_counters()
    sent_before = tx_bytes(iface)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds, tx_bytes(iface) - sent_before


@dataclass
class Trained:
    """One method's timed training on this worker: the model after it, what built it, the
    warm-up steps, each timed step's seconds and the bytes the interface sent meanwhile."""

    model: nn.Module
    compression: object
    optimizer_label: str
    setting: str
    warmup_steps: int
    seconds: List[float]
    sent_bytes: int


class Prepared:
    """One method ready to step on this worker: its model, what built it, the step."""

    def __init__(self, method: str, args: argparse.Namespace) -> None:
        self.method = method
        self.model, classes = build_model(args.model)
        module, optimizer, self.optimizer_label, self.setting, self.compression = \
            build_method(method, self.model, args)
        generator = torch.Generator().manual_seed(SEED + 1 + hvd.rank())
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        labels = torch.randint(0, classes, (args.batch_size,), generator=generator)

        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(module(images), labels).backward()
            optimizer.step()

        self.step = step
        self.warmup_steps = (max(args.warmup_steps, POWERSGD_START_ITER) if method == "powersgd"
                             else args.warmup_steps)

    def reset_counters(self) -> None:
        if self.compression is not None:
            self.compression.reset_stats()

    def trained(self, seconds: List[float], sent_bytes: int) -> "Trained":
        return Trained(self.model, self.compression, self.optimizer_label, self.setting, self.warmup_steps,
                       seconds, sent_bytes)


def train_method(method: str, args: argparse.Namespace) -> Trained:
    """Warm-up, then ``args.steps`` timed steps of ``method`` on synthetic images."""
    prepared = Prepared(method, args)
    seconds, sent = time_steps(prepared.step, prepared.warmup_steps, args.steps, args.iface,
                               prepared.reset_counters)
    return prepared.trained(seconds, sent)


def train_interleaved(methods: Sequence[str], args: argparse.Namespace) -> List[Trained]:
    """Every method built and warmed up in turn, then ``args.steps`` rounds of one timed step
    of each (the order turned by one each round), every rank at a barrier before each."""
    prepared = [Prepared(method, args) for method in methods]
    for method in prepared:
        for _ in range(method.warmup_steps):
            method.step()
        method.reset_counters()
    seconds: List[List[float]] = [[] for _ in prepared]
    sent = [0 for _ in prepared]
    for round_ in range(args.steps):
        for i in [(round_ + j) % len(prepared) for j in range(len(prepared))]:
            hvd.barrier()
            before, start = tx_bytes(args.iface), time.perf_counter()
            prepared[i].step()
            seconds[i].append(time.perf_counter() - start)
            sent[i] += tx_bytes(args.iface) - before
    return [method.trained(s, b) for method, s, b in zip(prepared, seconds, sent)]


def record(method: str, trained: Trained, args: argparse.Namespace) -> Record:
    """``method``'s record from every rank's timings (collectives: every rank calls it)."""
    model, compression, seconds, sent = trained.model, trained.compression, trained.seconds, trained.sent_bytes
    optimizer_label, setting, warmup = trained.optimizer_label, trained.setting, trained.warmup_steps
    params = sum(p.numel() for p in model.parameters())
    handed, estimated = estimate(method, model, compression, args.steps)
    idle = statistics.mean(per_worker_of_hosts(idle_per_s(args.iface)[0],
                                               f"cluster_step.idle.{method}"))
    all_seconds = hvd.allgather_object(seconds, name=f"cluster_step.seconds.{method}")
    slowest = [max(per_rank[i] for per_rank in all_seconds) for i in range(args.steps)]
    median_s = statistics.median(slowest)
    per_step = [s / args.steps for s in per_worker_of_hosts(sent, f"cluster_step.sent.{method}")]
    return Record(link=args.link, method=method, optimizer=optimizer_label, setting=setting,
                  workers=hvd.size(), model=args.model, params=params,
                  batch_size=args.batch_size, image_size=args.image_size, warmup_steps=warmup,
                  steps=args.steps,
                  median_step_s=median_s, images_per_s=hvd.size() * args.batch_size / median_s,
                  tx_bytes_per_step=statistics.mean(per_step), tx_bytes_per_step_max=max(per_step),
                  handed_bytes_per_step=handed, estimated_bytes_per_step=estimated,
                  idle_bytes_per_s=idle,
                  step_s=tuple(slowest), workers_per_host=hvd.local_size(),
                  buckets=compression.stats().buckets if hasattr(compression, "stats") else (),
                  interleaved=args.interleave)


def records(args: argparse.Namespace) -> Iterator[Record]:
    """Each method's record, methods one after another or interleaved."""
    if args.interleave:
        for method, trained in zip(args.methods, train_interleaved(args.methods, args)):
            yield record(method, trained, args)
        return
    for method in args.methods:
        yield record(method, train_method(method, args), args)
        gc.collect()


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Only dgc-hier adds process sets; the other methods run as Horovod runs by default.
    hvd.init(process_sets="dynamic" if set(HOST_METHODS) & set(args.methods) else None)
    if hvd.rank() == 0:
        print(f"cluster step: {hvd.size()} workers, link {args.link}, model {args.model}, "
              f"batch {args.batch_size} of {args.image_size}x{args.image_size} images per worker, "
              f"{args.warmup_steps}+{args.steps} steps per method"
              + (", timed steps interleaved" if args.interleave else ""), flush=True)
    for result in records(args):
        method = result.method
        if hvd.rank() == 0:
            print(f"{result.link:>10} {method:>10}: {result.median_step_s:8.3f} s/step, "
                  f"{result.images_per_s:8.1f} images/s, "
                  f"{result.tx_bytes_per_step / 1e6:9.3f} MB sent per worker per step"
                  + (f" (estimated {result.estimated_bytes_per_step / 1e6:.3f} MB, handed to the "
                     f"collectives {result.handed_bytes_per_step / 1e6:.3f} MB)"
                     if result.estimated_bytes_per_step is not None else "")
                  + f"; idle {result.idle_bytes_per_s / 1e3:.1f} kB/s",
                  flush=True)
            if args.out is not None:
                with open(args.out, "a") as out:
                    out.write(json.dumps(asdict(result)) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
