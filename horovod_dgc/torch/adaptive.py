"""The adaptive switch on PyTorch's Horovod paths (``adaptive=`` of every compressor): a
bucket's dense step, and the decisions taken at the end of a step (:mod:`..core.adaptive`).

A bucket in dense mode is flushed (``Engine.flush_bucket``: its gradients with every update
its memories owe) and averaged by one all-reduce under a name of its own. At a decision step
every rank times the same probes, and one all-reduce averages every rank's measurements, so
that every rank feeds the same numbers to the same rule and takes the same decision.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core.adaptive import DENSE, Adaptive, BucketTraffic, Decision, StepEnd, Switch
from ..core.bucket import Bucket
from ..core.collectives import ALLREDUCE
from .engine import REDUCIBLE, DenseExchange, Entry


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
        self._step_end = StepEnd(self.switch, self)

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

    def launch(self, label: str, entries: Sequence[Entry]) -> DenseExchange:
        """Every bucket of ``label`` flushed and its all-reduce launched (the compressor's
        ``finish_dense`` ends it)."""
        compressor = self.compressor
        buckets = compressor._buckets(label, entries)
        self.note(label, [bucket for bucket, _ in buckets], entries[0][1].device)
        return compressor.launch_updates("flush", [
            (compressor.engine.flush_bucket(bucket, [entries[i][1] for i in members], [entries[i][2] for i in members]),
             members) for bucket, members in buckets])

    def end_step(self) -> List[Decision]:
        """After every exchange of a step: keep its compute times if the next decision samples
        them, and decide if this is a decision step (every rank alike: collectives)."""
        engine = self.compressor.engine
        spent = engine.take_compute_s()  # drained every step, whatever the settings
        if self._noted_this_step:
            # A label no longer exchanged (DDP rebuilds its buckets after the first step)
            # is not decided on.
            self._buckets = {label: self._buckets[label] for label in sorted(self._noted_this_step)}
            self._noted_this_step = set()
        if self.switch.settings is None:
            return []
        compute_s = {label: sum(spent.get(b.key, 0.0) for b in buckets) for label, buckets in self._buckets.items()}
        return self._step_end(engine.steps_taken - 1, compute_s, self._traffic)

    def restore(self, modes: Optional[dict], steps_taken: int) -> None:
        """See :meth:`~horovod_dgc.core.adaptive.StepEnd.restore`."""
        self._step_end.restore(modes, steps_taken)

    def exchanged(self, seconds: float) -> None:
        """This rank waited ``seconds`` for an exchange to finish (the watch's input)."""
        self._step_end.exchanged(seconds)

    def _traffic(self) -> Dict[str, BucketTraffic]:
        engine = self.compressor.engine
        return {label: BucketTraffic(sum(b.numel * _wire_bytes(b) for b in buckets),
                                     tuple(e for b in buckets for e in engine.bucket_exchanges(b)))
                for label, buckets in self._buckets.items()}

    # -- the collectives of core.adaptive.StepEnd ------------------------------------------------
    def size(self) -> int:
        return self.compressor.transport.size()

    def rank(self) -> int:
        return self.compressor.transport.rank()

    def mean(self, values: Sequence[float], name: str) -> List[float]:
        return self._allreduce(torch.tensor(list(values), dtype=torch.float64, device=self.device), name).tolist()

    def allreduce_s(self, numel: int, name: str) -> float:
        probe = torch.zeros(numel, device=self.device)
        started = time.perf_counter()
        self._allreduce(probe, name)
        if probe.is_cuda:  # NCCL's wait only orders the streams
            torch.cuda.synchronize(probe.device)
        return time.perf_counter() - started

    def _allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The average over the ranks of ``tensor``, waited for; its bytes counted in
        ``stats()``."""
        transport, engine = self.compressor.transport, self.compressor.engine
        engine.record_allreduce(engine.steps_taken - 1, tensor.numel() * tensor.element_size())
        return transport.wait(transport.launch(ALLREDUCE, tensor, name))


def _wire_bytes(bucket: Bucket) -> int:
    """Bytes per element of a bucket's gradients on an all-reduce (bfloat16 travels as
    float32: Horovod reduces no bfloat16)."""
    dtype = getattr(torch, bucket.dtype)
    return torch.empty((), dtype=REDUCIBLE.get(dtype, dtype)).element_size()
