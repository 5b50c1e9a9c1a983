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
``spare`` (``CompressCall.spare``) offers storage for the new state, by name.
"""
from __future__ import annotations

from typing import Optional, Tuple

from .method import State
from .ops import Scalar, Tensor, TensorOps


def _reuse(spare: Optional[State], name: str) -> Optional[Tensor]:
    return None if spare is None else spare.get(name)


class ResidualMemory:
    """Plain error feedback: ``p = g + e``; after sending ``s``, ``e = p - s``."""

    state_names: Tuple[str, ...] = ("residual",)
    dense_state_names: Tuple[str, ...] = ()

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None) -> Tuple[Tensor, State]:
        residual = ops.add(state["residual"], grad, 1.0, grad_scale, out=_reuse(spare, "residual"))
        return residual, {"residual": residual}

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        return {"residual": ops.scatter_sub(state["residual"], indices, sent)}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
              spare: Optional[State] = None) -> Tuple[Tensor, State]:
        if isinstance(grad_scale, (int, float)) and grad_scale == 1.0:
            return ops.copy(grad), state
        return ops.scale(ops.copy(grad), grad_scale), state


class MomentumCorrectionMemory:
    """DGC's momentum correction with momentum factor masking (docs/algorithms.md#dgc).

    ``u = m * u + g; v = v + u`` (Nesterov: ``u = m * (u + g); v = v + u + g``); after
    sending ``v[I]``: ``v[I] -= sent`` and ``u[I] = 0``.
    """

    state_names: Tuple[str, ...] = ("momentum", "velocity")
    dense_state_names: Tuple[str, ...] = ("momentum",)

    def __init__(self, momentum: float, nesterov: bool):
        self.momentum = momentum
        self.nesterov = nesterov

    def _step_momentum(self, ops: TensorOps, momentum: Tensor, grad: Tensor,
                       grad_scale: Scalar, out: Optional[Tensor] = None) -> Tensor:
        m = self.momentum
        if self.nesterov:
            return ops.add(momentum, grad, m, grad_scale * m, out=out)
        return ops.add(momentum, grad, m, grad_scale, out=out)

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None) -> Tuple[Tensor, State]:
        momentum = self._step_momentum(ops, state["momentum"], grad, grad_scale,
                                       _reuse(spare, "momentum"))
        velocity = ops.add(state["velocity"], momentum, out=_reuse(spare, "velocity"))
        if self.nesterov:
            velocity = ops.scale_add(velocity, 1.0, grad, grad_scale)
        return velocity, {"momentum": momentum, "velocity": velocity}

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        return {"momentum": ops.scatter_zero(state["momentum"], indices),
                "velocity": ops.scatter_sub(state["velocity"], indices, sent)}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
              spare: Optional[State] = None) -> Tuple[Tensor, State]:
        """Momentum for a tensor that is not compressed: send ``u`` (Nesterov: ``u + g``)."""
        momentum = self._step_momentum(ops, state["momentum"], grad, grad_scale,
                                       _reuse(spare, "momentum"))
        if self.nesterov:
            update = ops.add(momentum, grad, 1.0, grad_scale)
        else:
            update = ops.copy(momentum)
        return update, {"momentum": momentum}


class LowPassMemory:
    """ScaleCom's low-pass filtered memory: ``p = m + g``; after sending ``s`` at I,
    ``m = (1 - beta) * m + beta * (p - s)``, i.e. ``m + beta * (g - s)``. ``beta = 1`` is
    plain error feedback (and then ``p`` and the memory share storage)."""

    state_names: Tuple[str, ...] = ("memory",)
    dense_state_names: Tuple[str, ...] = ()

    def __init__(self, beta: float):
        self.beta = beta

    def accumulate(self, ops: TensorOps, state: State, grad: Tensor, grad_scale: Scalar = 1.0,
                   spare: Optional[State] = None) -> Tuple[Tensor, State]:
        if self.beta == 1.0:
            p = ops.add(state["memory"], grad, 1.0, grad_scale, out=_reuse(spare, "memory"))
            return p, {"memory": p}
        p = ops.add(state["memory"], grad, 1.0, grad_scale)
        return p, {"memory": ops.add(state["memory"], grad, 1.0, grad_scale * self.beta,
                                     out=_reuse(spare, "memory"))}

    def update(self, ops: TensorOps, state: State, indices: Tensor, sent: Tensor) -> State:
        if self.beta != 1.0:
            # A copy: ``sent`` may be the very values the caller sends (scale may work in place).
            sent = ops.scale(ops.copy(sent), self.beta)
        return {"memory": ops.scatter_sub(state["memory"], indices, sent)}
