"""The adaptive switch on PyTorch's Horovod paths (``adaptive=`` of every compressor): a
bucket's dense step, and the decisions taken at the end of a step (:mod:`..core.adaptive`).

A bucket in dense mode is flushed (``Engine.flush_bucket``: its gradients with every update
its memories owe) and averaged by one all-reduce under a name of its own. At a decision step
every rank times the same probes, and one all-reduce averages every rank's measurements, so
that every rank feeds the same numbers to the same rule and takes the same decision.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.adaptive import DENSE, Adaptive, BucketCost, Decision, Link, Switch
from ..core.bucket import Bucket
from ..core.collectives import ALLREDUCE
from .engine import REDUCIBLE, DenseUpdate, Entry, in_entry_order


# Timed runs of each probe at a decision, after a first that is not counted (it may pay for
# Horovod's negotiation of a name it has not seen). Their mean counts: a collective waits for
# Horovod's next cycle, anywhere from none of it to all of it, as the exchanges of a step do.
PROBE_REPEATS = 2
# The first large probe's bytes (at most the largest bucket's): enough to see a network's rate
# past its latency (a 25 MB probe would take seconds on a slow link).
PROBE_BYTES = 4 * 2 ** 20
# A link on which the largest bucket's all-reduce is predicted under this is probed at that size.
FULL_PROBE_BELOW_S = 0.5


@dataclass
class FlushExchange:
    """A label's dense step in flight: per bucket, the all-reduce, what was sent, the bucket,
    its members' shapes and their places among the entries."""

    launched: List[Tuple[Any, DenseUpdate, Bucket, Tuple[torch.Size, ...], List[int]]]
    step: int


class AdaptiveExchanges:
    """One compressor's switch (:class:`~horovod_dgc.core.adaptive.Switch`) and what it needs
    from the compressor: the buckets of each label, their dense steps and the probes."""

    def __init__(self, compressor: Any, settings: Optional[Adaptive]) -> None:
        """``compressor``: the ``MethodCompressor`` that holds this switch."""
        self.compressor = compressor
        self.switch = Switch(settings)
        self._buckets: Dict[str, List[Bucket]] = {}
        self._noted_this_step: set = set()
        # Where the probes and measurements travel: the gradients' device (NCCL reduces CUDA
        # tensors only, and a probe should take the path the gradients take).
        self.device = torch.device("cpu")
        # Seconds this rank's exchanges took to finish, summed since the last watch.
        self.exchange_s = 0.0
        self._watched_steps = 0

    @property
    def labels(self) -> List[str]:
        """Every label exchanged so far."""
        return sorted(self._buckets)

    def note(self, label: str, buckets: Sequence[Bucket], device: torch.device) -> None:
        """``label``'s buckets, as it last exchanged them, from gradients on ``device``."""
        self._buckets[label] = list(buckets)
        self._noted_this_step.add(label)
        self.device = device

    def dense(self, label: str) -> bool:
        return self.switch.mode(label) == DENSE

    def launch(self, label: str, entries: Sequence[Entry]) -> FlushExchange:
        """Every bucket of ``label`` flushed and its all-reduce launched."""
        compressor, launched = self.compressor, []
        engine, transport = compressor.engine, compressor.transport
        buckets = compressor._buckets(label, entries)
        self.note(label, [bucket for bucket, _ in buckets], entries[0][1].device)
        for bucket, members in buckets:
            update = engine.flush_bucket(bucket, [entries[i][1] for i in members], [entries[i][2] for i in members])
            handle = transport.launch(ALLREDUCE, update.tensor, f"flush.{bucket.key}")
            launched.append((handle, update, bucket, tuple(entries[i][1].shape for i in members), members))
        return FlushExchange(launched, engine.steps_taken - 1)

    def finish(self, exchange: FlushExchange) -> List[torch.Tensor]:
        engine, transport = self.compressor.engine, self.compressor.transport
        places, averaged = [], []
        for handle, update, bucket, shapes, members in exchange.launched:
            averaged += engine.flushed(update, transport.wait(handle), bucket, shapes)
            places += members
        return in_entry_order(places, averaged)

    def end_step(self) -> List[Decision]:
        """After every exchange of a step: keep its compute times if the next decision samples
        them, and decide if this is a decision step (every rank alike: collectives)."""
        settings, engine = self.switch.settings, self.compressor.engine
        spent = engine.take_compute_s()  # drained every step, whatever the settings
        if self._noted_this_step:
            # A label no longer exchanged (DDP rebuilds its buckets after the first step)
            # is not decided on.
            self._buckets = {label: self._buckets[label] for label in sorted(self._noted_this_step)}
            self._noted_this_step = set()
        if settings is None:
            return []
        step = engine.steps_taken - 1
        self.switch.sample(step, {label: sum(spent.get(b.key, 0.0) for b in buckets)
                                  for label, buckets in self._buckets.items()})
        self._watched_steps += 1
        if settings.decides_at(step) or (self.switch.watches_at(step) and self._rescaled(step)):
            return self._decide(step)
        return []

    def _rescaled(self, step: int) -> bool:
        """The watch: the exchanges' seconds per step, averaged over the ranks, against the
        level the switch keeps (every rank alike)."""
        local = self._measured([self.exchange_s / max(self._watched_steps, 1)])
        self.exchange_s, self._watched_steps = 0.0, 0
        agreed = float(self._allreduce(local, "adaptive.watch")[0])
        return self.switch.rescaled(step, agreed)

    def _allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The average over the ranks of ``tensor``, waited for; its bytes counted in
        ``stats()``."""
        transport, engine = self.compressor.transport, self.compressor.engine
        engine.record_allreduce(engine.steps_taken - 1, tensor.numel() * tensor.element_size())
        return transport.wait(transport.launch(ALLREDUCE, tensor, name))

    def _decide(self, step: int) -> List[Decision]:
        compressor = self.compressor
        engine, transport, settings = compressor.engine, compressor.transport, self.switch.settings
        labels = sorted(self._buckets)
        dense_bytes = [sum(b.numel * _wire_bytes(b) for b in self._buckets[label]) for label in labels]
        world = transport.size()
        link = Link.given(settings) or self._probe_link(max(dense_bytes, default=4), world)
        local = self._measured(self.switch.local_compute_s(labels))
        agreed = self._allreduce(local, "adaptive.measurements").tolist()
        costs = [BucketCost(label, nbytes, tuple(e for b in self._buckets[label] for e in engine.bucket_exchanges(b)),
                            compute_s)
                 for label, nbytes, compute_s in zip(labels, dense_bytes, agreed)]
        before = {label: self.switch.mode(label) for label in labels}
        decisions = self.switch.decide(step, costs, link, world)
        self.exchange_s, self._watched_steps = 0.0, 0
        if transport.rank() == 0:
            for decision in decisions:
                if decision.mode != before[decision.label]:
                    print(f"horovod_dgc: {decision}", file=sys.stderr, flush=True)
        return decisions

    def _probe_link(self, largest_bytes: int, world_size: int) -> Link:
        """The link from timed all-reduces, averaged over the ranks: one element, then
        PROBE_BYTES (at most the largest bucket's bytes); then the largest bucket's size
        itself where that link says it takes under FULL_PROBE_BELOW_S. Where the link is
        memory (one host) a few MiB stay in the caches and read faster per byte than a 25 MB
        bucket; a slow link is not worth a bucket-size probe, and is linear in the bytes."""
        first = min(largest_bytes, PROBE_BYTES)
        small, large = self._allreduce(self._measured([self._timed(1, "small"), self._timed(first // 4, "large")]),
                                       "adaptive.probes").tolist()
        link = Link.from_probes(small, large, first, world_size)
        if largest_bytes > first and link.time_s(ALLREDUCE, largest_bytes, world_size) < FULL_PROBE_BELOW_S:
            full = float(self._allreduce(self._measured([self._timed(largest_bytes // 4, "full")]),
                                         "adaptive.probes.full")[0])
            link = Link.from_probes(small, full, largest_bytes // 4 * 4, world_size)
        return link

    def _timed(self, numel: int, name: str) -> float:
        """Seconds of an averaging all-reduce of ``numel`` float32 zeros: the mean of
        PROBE_REPEATS runs after a first."""
        probe, seconds = torch.zeros(numel, device=self.device), []
        for _ in range(PROBE_REPEATS + 1):
            started = time.perf_counter()
            self._allreduce(probe, f"adaptive.probe.{name}")
            if probe.is_cuda:  # NCCL's wait only orders the streams
                torch.cuda.synchronize(probe.device)
            seconds.append(time.perf_counter() - started)
        return statistics.mean(seconds[1:])

    def _measured(self, seconds: Sequence[float]) -> torch.Tensor:
        """Measurements to all-reduce, on the gradients' device."""
        return torch.tensor(list(seconds), dtype=torch.float64, device=self.device)


def _wire_bytes(bucket: Bucket) -> int:
    """Bytes per element of a bucket's gradients on an all-reduce (bfloat16 travels as
    float32: Horovod reduces no bfloat16)."""
    dtype = getattr(torch, bucket.dtype)
    return torch.empty((), dtype=REDUCIBLE.get(dtype, dtype)).element_size()
