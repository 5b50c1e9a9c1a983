"""Elastic Horovod: the compressor's memories as part of the committed state.

    state = horovod_dgc.torch.elastic.TorchState(model, optimizer, compression=compression,
                                                 epoch=0, batch=0)

``commit()`` pools the memories of all workers (:mod:`.checkpoint`: per-worker memories
averaged by an all-reduce, blocksign's server shards gathered), which costs one dense
all-reduce of the memories per commit. After a reset, whether a worker was lost or added,
every rank takes its share of the last commit: the same averaged memories on every rank,
its slice of the server residual, the committed step counters. What is owed to the
parameters is what it was at the commit, so no gradient mass is lost, and the parameters,
restored to the same commit, stay identical on every rank.

Uncommitted memories (the steps since the last commit) are rolled back with the parameters.
Works with the stock ``hvd.DistributedOptimizer`` and with our fused ``DistributedOptimizer``,
whose compressor it takes when ``compression`` is not given, and whose step interrupted by a
reset it abandons.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional

import horovod.torch as hvd
import torch
from horovod.torch.elastic.state import OptimizerStateHandler, StateHandler

from ..core.state import with_states
from .checkpoint import shard
from .compression import MethodCompressor
from .optimizer import is_fused


def pool_across_ranks(compressor: MethodCompressor) -> dict:
    """The pooled state (see :func:`horovod_dgc.core.state.pool`) by collectives; every rank calls it,
    at the same point of training."""
    state = compressor.state_dict()
    sharded = set(compressor.method.state_layout(True).sharded)
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    for name in sorted(state["states"]):
        tensors = state["states"][name]
        numel = next((v.numel() for k, v in tensors.items() if k not in sharded), 0)
        states[name] = {}
        for key in sorted(tensors):
            value, label = tensors[key], f"horovod_dgc.pool.{key}.{name}"
            if key in sharded:
                states[name][key] = hvd.allgather(value, name=label)[:numel].clone()
            else:
                total = hvd.allreduce(value.double(), op=hvd.Sum, name=label)
                states[name][key] = (total / hvd.size()).to(value.dtype)
    return with_states(state, None, None, states)


class CompressorStateHandler(StateHandler):
    """Commits, restores and synchronizes a compressor's memories (see the module doc)."""

    def __init__(self, compressor: MethodCompressor):
        if compressor.hierarchical:
            raise ValueError("elastic training changes the hosts, while a compressor built with "
                             "hierarchical=True keeps the process sets it was built with: "
                             "build it without hierarchical for elastic jobs")
        super().__init__(compressor)
        self._committed: Optional[dict] = None

    def save(self) -> None:
        self._committed = pool_across_ranks(self.value)

    def restore(self) -> None:
        self.rejoin()

    def sync(self) -> None:
        self._committed = hvd.broadcast_object(self._committed, root_rank=0,
                                               name="horovod_dgc.committed")
        self.rejoin()

    def rejoin(self) -> None:
        """Take this rank's place in the current world and its share of the last commit."""
        engine = self.value.engine
        engine.join(hvd.size(), hvd.rank())
        self.value.abandon_exchanges()
        if self._committed is not None:
            self.value.load_state_dict(shard(self._committed, hvd.size(), hvd.rank()))


class FusedOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer handler for our fused optimizer, less the compressor part that its
    ``state_dict()`` carries: :class:`CompressorStateHandler` commits the memories pooled
    across ranks, and copying this rank's own at each commit (a clone, then a deep copy, of
    every memory) would only be thrown away."""

    def __init__(self, optimizer):
        StateHandler.__init__(self, optimizer)
        self.save()

    def save(self) -> None:
        self._saved_optimizer_state = copy.deepcopy(self.value.wrapped_state_dict())


class TorchState(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState`` that also commits ``compression``'s memories (by default,
    those of the compressor inside our fused ``optimizer``)."""

    def __init__(self, model=None, optimizer=None, compression: Optional[MethodCompressor] = None,
                 **kwargs):
        fused = optimizer is not None and is_fused(optimizer)
        if fused:
            if compression not in (None, optimizer._compression):
                raise ValueError("compression= is not the compressor of the fused optimizer: leave "
                                 "it out, the optimizer's own is committed")
            compression = optimizer._compression
        super().__init__(model, optimizer, **kwargs)
        if fused:
            self._handlers["optimizer"] = FusedOptimizerStateHandler(optimizer)
            self.register_reset_callbacks([optimizer.abandon_step])
        if compression is not None:
            handler = CompressorStateHandler(compression)
            self._handlers["compression"] = handler
            self.register_reset_callbacks([handler.rejoin])
