"""Methods that exchange in two collective stages, and an in-process simulation of N workers.

ScaleCom (broadcast of the leader's indices, then an all-reduce of everyone's values at
them) and blocksign (alltoall of compressed shards to their "server" worker, then an
allgather of the re-compressed shards) share this shape:

    stage 1:  message1 = first(state, grad)        -> collective ``FIRST``  -> received1
    stage 2:  message2 = second(state, received1)  -> collective ``SECOND`` -> received2
    result:   finish(received2)                     (the averaged update, dense)

The framework glue runs the collectives with Horovod; :func:`simulate_step` runs them
in one process over a list of worker states, and is the reference the multi-process tests
compare against.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from .config import CompressionConfig
from .memory import State
from .ops import Tensor, TensorOps
from .sparse import StepContext, state_dtype

BROADCAST = "broadcast"  # everyone receives the root's message (root from ``root()``)
ALLREDUCE = "allreduce"  # everyone receives the average of all messages
ALLTOALL = "alltoall"    # worker j receives chunk j of every worker's message, in rank order
ALLGATHER = "allgather"  # everyone receives all messages, concatenated in rank order


@dataclass
class Pending:
    """What stage 1 of one tensor leaves for the later stages, on one worker."""

    ctx: StepContext
    numel: int
    dtype: str
    data: Dict[str, Any] = field(default_factory=dict)


class TwoStageMethod(ABC):
    """A method exchanging through ``FIRST`` then ``SECOND`` (module constants)."""

    method_id: int
    FIRST: str
    SECOND: str
    config: CompressionConfig

    def __init__(self, config: CompressionConfig):
        self.config = config

    def root(self, ctx: StepContext) -> int:
        """Rank whose message a BROADCAST stage sends."""
        return 0

    @abstractmethod
    def state_names(self, compressed: bool) -> Tuple[str, ...]:
        """Names of the per-tensor state tensors (same length as the flat gradient)."""

    def init_state(self, ops: TensorOps, grad: Tensor, compressed: bool) -> State:
        dtype = state_dtype(ops.dtype(grad))
        return {name: ops.zeros(ops.numel(grad), dtype, like=grad)
                for name in self.state_names(compressed)}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, ctx: StepContext) -> Tuple[Tensor, State]:
        """What to all-reduce for a tensor that is not compressed, and the new state."""
        return grad, state

    @abstractmethod
    def first(self, ops: TensorOps, state: State, grad: Tensor,
              ctx: StepContext) -> Tuple[Tensor, State, Pending]:
        """Stage 1: the message for the FIRST collective."""

    @abstractmethod
    def second(self, ops: TensorOps, state: State, received: Tensor,
               pending: Pending) -> Tuple[Tensor, State]:
        """Stage 2: the message for the SECOND collective, from what FIRST delivered."""

    @abstractmethod
    def finish(self, ops: TensorOps, received: Tensor, pending: Pending) -> Tensor:
        """The averaged update (flat, the gradient's dtype) from what SECOND delivered."""


def emulate(ops: TensorOps, kind: str, messages: Sequence[Tensor], root: int = 0) -> List[Tensor]:
    """What each of ``len(messages)`` workers receives from collective ``kind``."""
    n = len(messages)
    if kind == BROADCAST:
        return [messages[root]] * n
    if kind == ALLREDUCE:
        total = ops.copy(messages[0])
        for message in messages[1:]:
            total = ops.scale_add(total, 1.0, message)
        return [ops.scale(total, 1.0 / n)] * n
    if kind == ALLGATHER:
        return [ops.concat(messages)] * n
    if kind == ALLTOALL:
        chunk = ops.numel(messages[0]) // n
        return [ops.concat([ops.slice(m, j * chunk, chunk) for m in messages]) for j in range(n)]
    raise ValueError(f"unknown collective {kind!r}")


def simulate_step(ops: TensorOps, method: TwoStageMethod, states: List[State],
                  grads: Sequence[Tensor], ctxs: Sequence[StepContext]) -> Tuple[List[Tensor], List[State]]:
    """One step of ``len(states)`` workers in this process: (each worker's result, states)."""
    firsts = [method.first(ops, state, grad, ctx) for state, grad, ctx in zip(states, grads, ctxs)]
    received = emulate(ops, method.FIRST, [m for m, _, _ in firsts], method.root(ctxs[0]))
    seconds = [method.second(ops, state, r, pending)
               for (_, state, pending), r in zip(firsts, received)]
    received = emulate(ops, method.SECOND, [m for m, _ in seconds], method.root(ctxs[0]))
    results = [method.finish(ops, r, pending) for r, (_, _, pending) in zip(received, firsts)]
    return results, [state for _, state in seconds]
