"""Error feedback: what a worker keeps of the gradient it has not sent yet.

A memory turns this step's gradient into the tensor selection picks from (``accumulate``),
then removes what was actually sent (``update``). Both keep the invariant that no gradient
mass is lost: ``sent + memory`` after the step equals ``memory + gradient`` before it (for the
plain residual; momentum correction keeps it for the accumulated velocity).

``sent`` is always the value the receivers decode, so rounding to the wire dtype stays here too.
State is a dict of flat tensors owned by the caller. ``accumulate`` and ``dense`` never
overwrite the state they are given (the new state is new tensors), so that a step the workers
agree to drop (a non-finite gradient on some rank) leaves the memories exactly as they were;
``update`` may overwrite the tensors ``accumulate`` returned.

``grad_scale`` multiplies the gradient before it enters the memory: DGC's clipping factor,
and the inverse of a mixed-precision loss scale, so that memories hold unscaled gradients.
``spare`` (``CompressCall.spare``) offers storage for the new state, by name. ``block``: the
selection's block length, whose per-block maxima the accumulation computes in the same pass
(0: none).

``flush`` is the step of a compressed tensor sent dense (an adaptive switch): the gradient
with all the memory held back, after which the memory named ``pending`` holds nothing (a
momentum goes on as dense momentum SGD's). Sent in full, it keeps the same invariant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .method import State, emptied
from .ops import Bound, Candidates, Scalar, Tensor, TensorOps


def reuse(spare: Optional[State], name: str) -> Optional[Tensor]:
    """The spare storage for memory ``name``, if any."""
    return None if spare is None else spare.get(name)


@dataclass(frozen=True)
class Accumulated:
    """A memory's accumulation of one gradient.

    Attributes:
        x: what the selection picks from.
        state: the memories after the step, new tensors (kept only if every rank was finite).
        finite: whether the gradient was finite.
        block_max: max ``|x|`` per block of the requested length (None when none was asked).
        candidates: the entries of ``x`` reaching a bound given before the pass (None when
            none was given).
    """

    x: Tensor
    state: State
    finite: Scalar
    block_max: Optional[Tensor]
    candidates: Optional[Candidates] = None


class ResidualMemory:
    """Plain error feedback: ``p = g + e``; after sending ``s``, ``e = p - s``."""

    state_names: Tuple[str, ...] = ("residual",)
    dense_state_names: Tuple[str, ...] = ()
    pending: str = "residual"

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None, block: int = 0, bound: Bound = None,
                   capacity: int = 0) -> Accumulated:
        """``p = e + grad_scale * g``; with a ``bound`` (and a block), also the candidates of
        ``p`` at it (:meth:`TensorOps.candidates`, at most ``capacity`` entries)."""
        residual, maxima, finite, candidates = ops.accumulate(
            state["residual"], grad, grad_scale, reuse(spare, "residual"), block, "max", bound, capacity)
        return Accumulated(residual, {"residual": residual}, finite, maxima, candidates)

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        return {"residual": ops.scatter_sub(state["residual"], indices, sent)}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
              spare: Optional[State] = None) -> Tuple[Tensor, State]:
        if isinstance(grad_scale, (int, float)) and grad_scale == 1.0:
            return ops.copy(grad), state
        return ops.scale(ops.copy(grad), grad_scale), state

    def flush(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0) -> Tuple[Tensor, State]:
        """``e + grad_scale * g``; the residual emptied."""
        return ops.add(state["residual"], grad, 1.0, grad_scale), emptied(ops, state, "residual")


class MomentumCorrectionMemory:
    """DGC's momentum correction with momentum factor masking (docs/algorithms.md#dgc).

    ``u = m * u + g; v = v + u`` (Nesterov: ``u = m * (u + g); v = v + u + g``); after
    sending ``v[I]``: ``v[I] -= sent`` and, when ``masked``, ``u[I] = 0``.

    Unmasked, every gradient's whole momentum is sent sooner or later: momentum SGD with
    error feedback, the same updates as the dense momentum SGD, delayed. Masking cuts an
    entry's momentum each time it is sent, so an entry sent every s steps moves
    ``1 - m (1 - m^s) / (s (1 - m))`` of momentum SGD's pace (0.61 at s = 20, 0.23 at s = 4).
    """

    state_names: Tuple[str, ...] = ("momentum", "velocity")
    dense_state_names: Tuple[str, ...] = ("momentum",)
    pending: str = "velocity"

    def __init__(self, momentum: float, nesterov: bool, masked: bool = True):
        self.momentum = momentum
        self.nesterov = nesterov
        self.masked = masked

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None, block: int = 0, bound: Bound = None,
                   capacity: int = 0) -> Accumulated:
        """As the other memories'; with a ``bound`` (and a block), also the candidates of the
        velocity at it (:meth:`TensorOps.candidates`, at most ``capacity`` entries)."""
        outs = (reuse(spare, "momentum"), reuse(spare, "velocity"))
        momentum, velocity, maxima, finite, candidates = ops.momentum_accumulate(
            state["momentum"], state["velocity"], grad, self.momentum, grad_scale, self.nesterov,
            outs, block, bound, capacity)
        return Accumulated(velocity, {"momentum": momentum, "velocity": velocity}, finite, maxima,
                           candidates)

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        momentum = ops.scatter_zero(state["momentum"], indices) if self.masked else state["momentum"]
        return {"momentum": momentum, "velocity": ops.scatter_sub(state["velocity"], indices, sent)}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
              spare: Optional[State] = None) -> Tuple[Tensor, State]:
        """Momentum for a tensor that is not compressed: send ``u`` (Nesterov: ``u + g``)."""
        momentum = ops.momentum_step(state["momentum"], grad, self.momentum, grad_scale,
                                     self.nesterov, out=reuse(spare, "momentum"))
        if self.nesterov:
            update = ops.add(momentum, grad, 1.0, grad_scale)
        else:
            update = ops.copy(momentum)
        return update, {"momentum": momentum}

    def flush(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0) -> Tuple[Tensor, State]:
        """The velocity plus :meth:`dense`'s update (``u = m * u + g``, unmasked; send
        ``v + u``, Nesterov ``v + u + g``); the velocity emptied, the momentum kept."""
        update, dense_state = self.dense(ops, state, grad, grad_scale)
        return (ops.add(update, state["velocity"]),
                emptied(ops, {**state, **dense_state}, "velocity"))


class LowPassMemory:
    """ScaleCom's low-pass filtered memory: ``p = m + g``; after sending ``s`` at I,
    ``m = (1 - beta) * m + beta * (p - s)``, i.e. ``m + beta * (g - s)``. ``beta = 1`` is
    plain error feedback (and then ``p`` and the memory share storage)."""

    state_names: Tuple[str, ...] = ("memory",)
    dense_state_names: Tuple[str, ...] = ()
    pending: str = "memory"

    def __init__(self, beta: float):
        self.beta = beta

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None, block: int = 0, bound: Bound = None,
                   capacity: int = 0) -> Accumulated:
        """As :class:`ResidualMemory`'s, candidates of ``p`` included."""
        plain = self.beta == 1.0
        p, maxima, finite, candidates = ops.accumulate(
            state["memory"], grad, grad_scale, reuse(spare, "memory") if plain else None, block,
            "max", bound, capacity)
        if plain:
            return Accumulated(p, {"memory": p}, finite, maxima, candidates)
        memory = ops.add(state["memory"], grad, 1.0, grad_scale * self.beta, out=reuse(spare, "memory"))
        return Accumulated(p, {"memory": memory}, finite, maxima, candidates)

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        if self.beta != 1.0:
            # A copy: ``sent`` may be the very values the caller sends (scale may work in place).
            sent = ops.scale(ops.copy(sent), self.beta)
        return {"memory": ops.scatter_sub(state["memory"], indices, sent)}

    def flush(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0) -> Tuple[Tensor, State]:
        """``m + grad_scale * g``; the memory emptied."""
        return ops.add(state["memory"], grad, 1.0, grad_scale), emptied(ops, state, "memory")
