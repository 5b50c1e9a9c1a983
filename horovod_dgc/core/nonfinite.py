"""What a NaN or Inf gradient does, in every family: the sender flags its message and keeps
its memory; every receiver learns of the flag, so every rank drops the step alike (each
memory stays as it was), and either raises or passes NaN on, as a dense all-reduce would
(``CompressionConfig.nonfinite``)."""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

from .ops import Scalar, Tensor, TensorOps
from .wire import FLAG_NONFINITE, id_inputs, name_of


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank; every memory was left as it was."""


def settle(ops: TensorOps, policy: str, finite: Scalar, inputs: Sequence[Any],
           culprit: Callable[..., str], step: Any) -> Scalar:
    """``finite``, after raising :class:`NonFiniteGradientError` (``policy == "raise"``)
    when it is false, with ``culprit(*values of inputs)`` naming the tensor and the rank."""
    if policy != "raise":
        return finite

    def explain(*values: Any) -> None:
        raise NonFiniteGradientError(
            f"gradient of {culprit(*values[:-1])} held NaN or Inf at step {values[-1]}; every "
            f"memory was left as it was before this step")

    return ops.verify(finite, [*inputs, step], explain, finite)


def settle_tensor(ops: TensorOps, policy: str, finite: Scalar, name: str, traced_id: Any,
                  step: Any) -> Scalar:
    """:func:`settle` for one tensor on some rank, named ``name``, or by the run-time id
    ``traced_id`` where one trace serves several tensors (``CompressCall.traced_id``)."""
    def culprit(*word: int) -> str:
        return f"tensor {(name_of(word[0]) if word else name)!r} on some rank"

    return settle(ops, policy, finite, id_inputs(traced_id), culprit, step)


def received_finite(ops: TensorOps, policy: str, flags: Tensor, names: Sequence[str],
                    step: Any, traced_id: Any = None) -> Scalar:
    """Whether no sender flagged a non-finite gradient (``flags``: one word per message, the
    messages of ``names`` rank after rank); see :func:`settle`. ``traced_id``: the run-time id of
    the one tensor of ``names``, where one trace serves several tensors (``wire.receive``)."""
    def culprit(values: List[int], *word: int) -> str:
        named = [name_of(word[0])] if word else names
        flagged = [(i // len(named), named[i % len(named)]) for i, v in enumerate(values) if v]
        rank, name = flagged[0]
        more = f" (and {len(flagged) - 1} more)" if len(flagged) > 1 else ""
        return f"tensor {name!r} on rank {rank}{more}"

    return settle(ops, policy, none_flagged(ops, flags), [flags, *id_inputs(traced_id)], culprit, step)


def flag(ops: TensorOps, finite: Scalar) -> Any:
    """The flags word of a message whose sender's gradient is (not) finite."""
    return ops.where(finite, 0, FLAG_NONFINITE)


def nan_like(ops: TensorOps, n: int, dtype: str, like: Tensor) -> Tensor:
    """``n`` NaNs: the averaged gradient of a tensor some rank could not send."""
    return ops.scale(ops.zeros(n, dtype, like=like), float("nan"))


def nan_unless(ops: TensorOps, finite: Scalar, x: Tensor, dtype: str) -> Tensor:
    """``x`` where ``finite``, else NaNs like it in ``dtype`` (what a dense all-reduce hands
    every rank when some rank's gradient was not finite). Where checks are deferred (a GPU),
    no branch reads the flag: ``x`` is multiplied in place by 1 or by NaN."""
    if ops.defers_checks(x):
        return ops.scale(x, ops.where(finite, 1.0, float("nan")))
    return ops.cond(finite, lambda: x, lambda: nan_like(ops, ops.numel(x), dtype, x))


def none_flagged(ops: TensorOps, flags: Tensor) -> Scalar:
    """Whether every flags word is 0."""
    return ops.all_within(flags, 0, 0)
