"""The two-stage family: methods that exchange one tensor through two collectives in a row,
and an in-process simulation of N workers.

ScaleCom (broadcast of the leader's indices, then an all-reduce of everyone's values at
them) and blocksign (alltoall of compressed shards to their "server" worker, then an
allgather of the re-compressed shards) share this shape:

    stage 1:  message1 = first(state, grad)            -> collective ``FIRST``  -> received1
    stage 2:  message2 = second(state, received1)      -> collective ``SECOND`` -> received2
    result:   finish(received2)                         (the averaged update, dense)

The adapters run the collectives with Horovod; :func:`simulate_step` runs them in one
process over a list of worker states, and is the reference the multi-process tests compare
against.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from .collectives import emulate
from .method import CompressCall, Method, State
from .ops import Scalar, Tensor, TensorOps


@dataclass
class StageHandover:
    """What stage 1 of one tensor hands over to stage 2 and ``finish``, on one worker.
    ``next_bound``: the tensor's next ``CompressCall.candidate_bound`` for a method that
    ``collects_candidates``, else None. ``destination``: a flat tensor of the update's size
    in the state dtype whose contents are no longer needed (the gradient stage 1 took), over
    which ``finish`` may write the update, or None (an adapter sets it). ``chunks``: the
    elements of stage 1's alltoall message for each destination, where they are not equal
    (:meth:`~.collectives.Transport.launch`'s), else None."""

    call: CompressCall
    numel: int
    dtype: str
    data: Dict[str, Any] = field(default_factory=dict)
    next_bound: Optional[Scalar] = None
    destination: Optional[Tensor] = None
    chunks: Optional[Tuple[int, ...]] = None


class TwoStageMethod(Method):
    """A method exchanging through ``FIRST`` then ``SECOND`` (kinds of :mod:`.collectives`)."""

    family: ClassVar[str] = "two-stage"
    FIRST: ClassVar[str]
    SECOND: ClassVar[str]

    def root(self, call: CompressCall) -> Any:
        """Rank whose message a BROADCAST stage sends."""
        return 0

    @abstractmethod
    def first(self, ops: TensorOps, state: State, grad: Tensor,
              call: CompressCall) -> Tuple[Tensor, State, StageHandover]:
        """Stage 1: the message for the FIRST collective."""

    @abstractmethod
    def second(self, ops: TensorOps, state: State, received: Tensor,
               handover: StageHandover) -> Tuple[Tensor, State]:
        """Stage 2: the message for the SECOND collective, from what FIRST delivered."""

    @abstractmethod
    def finish(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> Tuple[Tensor, Scalar]:
        """The averaged update (flat, the gradient's dtype) from what SECOND delivered, and
        whether every rank's gradient was finite (else the update is NaN)."""


def simulate_step(ops: TensorOps, method: TwoStageMethod, states: List[State],
                  grads: Sequence[Tensor], calls: Sequence[CompressCall]) -> Tuple[List[Tensor], List[State]]:
    """One step of ``len(states)`` workers in this process: (each worker's result, states)."""
    firsts = [method.first(ops, state, grad, call) for state, grad, call in zip(states, grads, calls)]
    received = emulate(ops, method.FIRST, [m for m, _, _ in firsts], method.root(calls[0]), firsts[0][2].chunks)
    seconds = [method.second(ops, state, r, handover)
               for (_, state, handover), r in zip(firsts, received)]
    received = emulate(ops, method.SECOND, [m for m, _ in seconds], method.root(calls[0]))
    results = [method.finish(ops, r, handover)[0] for r, (_, _, handover) in zip(received, firsts)]
    return results, [state for _, state in seconds]
