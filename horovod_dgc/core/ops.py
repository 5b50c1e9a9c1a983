"""The tensor-operations interface the framework-free core is written against.

Every algorithm in :mod:`horovod_dgc.core` works on flat (1-D) tensors through a
:class:`TensorOps` object and never imports a framework. ``horovod_dgc.torch.ops`` and
``horovod_dgc.tensorflow.ops`` implement it.

Conventions:

* Arithmetic methods whose first argument is named ``out`` may overwrite it and return it
  (PyTorch updates in place) or return a new tensor (TensorFlow, functional); the caller always
  uses the returned tensor and never reads the old one again.
* Scalars that depend on data (norms, thresholds, counts) stay tensors, so TensorFlow can build
  a graph; :meth:`while_loop` and :meth:`cond` are the only control flow the core uses.
* Dtypes are named by strings: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``,
  ``"int32"``, ``"int64"``, ``"int8"``, ``"uint8"``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

Tensor = Any
Scalar = Any  # a 0-d tensor or a Python number


class BlockBounds(NamedTuple):
    """A candidate bound per block of a memory pass's statistic (a bucket's tensors, each at
    its own): ``values``, float32, one per block."""

    values: Tensor


# A candidate bound: a number (or a 0-d tensor), or BlockBounds.
Bound = Any


class Pieces(NamedTuple):
    """A bucket's gradient as its members' own tensors, not yet copied into the bucket's flat
    buffer: ``flat``, that buffer (the bucket's layout, zero padding; what its segments hold
    is not the gradient until :meth:`TensorOps.gathered` writes it there), and ``parts``, the members' gradients
    (1-D), part i at entry ``offsets[i]`` of the layout, zeros between them. A memory's pass
    may read the parts where they lie; anything else reads :meth:`TensorOps.gathered`."""

    flat: Tensor
    parts: Tuple[Tensor, ...]
    offsets: Tuple[int, ...]


def buffer_of(grad: Any) -> Tensor:
    """The flat buffer of a gradient given as :class:`Pieces`, else the gradient itself: for
    its device, dtype and length, not its values."""
    return grad.flat if isinstance(grad, Pieces) else grad


class Candidates(NamedTuple):
    """The entries of a tensor with ``|x| >= bound``, for a bound known before the pass that
    made the tensor: int64 positions (ascending) and float32 magnitudes, both empty when more
    than the capacity asked for reached the bound, and ``count``, how many reached it (with
    :class:`BlockBounds`: an int64 tensor of how many of each block's entries reached its own)."""

    positions: Tensor
    magnitudes: Tensor
    count: Scalar
    bound: Bound


class TensorOps(ABC):
    """Operations on flat tensors; one implementation per framework."""

    # -- shape, dtype, construction -------------------------------------------------------
    @abstractmethod
    def numel(self, x: Tensor) -> int:
        """Number of elements, known when the graph is built."""

    @abstractmethod
    def dtype(self, x: Tensor) -> str:
        """The dtype name of ``x``."""

    @abstractmethod
    def cast(self, x: Tensor, dtype: str) -> Tensor:
        """``x`` converted to ``dtype`` (no copy when it already has it)."""

    @abstractmethod
    def zeros(self, n: int, dtype: str, like: Tensor) -> Tensor:
        """A new tensor of ``n`` zeros on the device of ``like``."""

    @abstractmethod
    def zeroed(self, x: Tensor) -> Tensor:
        """Zeros shaped like ``x``, written over ``x`` where the framework allows."""

    def scratch(self, n: int, dtype: str, like: Tensor) -> Tensor:
        """A new tensor of ``n`` elements that the caller overwrites entirely: zeros here, left
        unwritten where the framework allows."""
        return self.zeros(n, dtype, like)

    @abstractmethod
    def constant(self, values: Sequence[Any], dtype: str, like: Tensor) -> Tensor:
        """A small 1-D tensor of ``values`` (Python numbers or 0-d tensors) on the device of
        ``like``."""

    def constants_key(self, like: Tensor) -> Any:
        """What constant tensors made for ``like`` (:meth:`constant`) can be reused for: any
        tensor of the same key. The framework and the device; an adapter adds what else
        binds a tensor (a TensorFlow graph)."""
        return type(self), getattr(like, "device", None)

    @abstractmethod
    def ones(self, n: int, dtype: str, like: Tensor) -> Tensor:
        """A new tensor of ``n`` ones on the device of ``like`` (``n`` may be a run-time
        scalar)."""

    @abstractmethod
    def copy(self, x: Tensor) -> Tensor:
        """A new tensor equal to ``x`` (never aliases it)."""

    @abstractmethod
    def concat(self, parts: Sequence[Tensor]) -> Tensor:
        """The 1-D concatenation of ``parts`` (all of one dtype)."""

    @abstractmethod
    def slice(self, x: Tensor, start: int, length: int) -> Tensor:
        """``x[start:start + length]`` with static bounds."""

    # -- elementwise arithmetic and reductions ---------------------------------------------
    def rows(self, x: Tensor, start: int, stride: int, length: int, count: int) -> Tensor:
        """``x[start + r * stride : start + r * stride + length]`` for ``r`` in ``range(count)``,
        concatenated: the same part of ``count`` equal messages laid end to end. A
        composition; an adapter may copy them in one strided pass instead."""
        return self.concat([self.slice(x, start + r * stride, length) for r in range(count)])

    @abstractmethod
    def row_cumsum(self, x: Tensor, row: int) -> Tensor:
        """The inclusive running sum of each row of ``row`` entries of an integer or boolean
        tensor (``numel`` a multiple of ``row``), restarting at every row, as int64."""

    @abstractmethod
    def scale_add(self, out: Tensor, alpha: Scalar, x: Tensor, beta: Scalar = 1.0) -> Tensor:
        """``out * alpha + x * beta`` (may overwrite ``out``)."""

    @abstractmethod
    def scale(self, out: Tensor, alpha: Scalar) -> Tensor:
        """``out * alpha`` (may overwrite ``out``)."""

    @abstractmethod
    def add(self, x: Tensor, y: Tensor, alpha: Scalar = 1.0, beta: Scalar = 1.0,
            out: Optional[Tensor] = None) -> Tensor:
        """``x * alpha + y * beta`` as a new tensor (no argument is overwritten), in the wider
        of the two dtypes (``y`` may be a Python number, added to every element); rounded as :meth:`scale_add` rounds it. ``out``: a tensor shaped
        and typed like ``x``, overlapping neither input, whose storage may hold the result
        (a framework without in-place writes ignores it)."""

    @abstractmethod
    def multiply(self, x: Tensor, y: Tensor) -> Tensor:
        """``x * y`` elementwise, as a new tensor."""

    @abstractmethod
    def sum(self, x: Tensor) -> Scalar:
        """Sum of all elements, a 0-d tensor, accumulated in float32 at least (a float16 sum
        of finite values overflows)."""

    @abstractmethod
    def dot(self, x: Tensor, y: Tensor) -> Scalar:
        """Inner product, a 0-d tensor, in float32 at least."""

    @abstractmethod
    def clamp(self, x: Tensor, bound: float) -> Tensor:
        """``x`` with every element limited to ``[-bound, bound]`` (a new tensor)."""

    @abstractmethod
    def abs(self, x: Tensor) -> Tensor:
        """Elementwise absolute value (new tensor)."""

    @abstractmethod
    def sqrt(self, s: Scalar) -> Scalar:
        """Square root of a scalar tensor."""

    @abstractmethod
    def minimum(self, a: Scalar, b: Scalar) -> Scalar:
        """Elementwise minimum."""

    @abstractmethod
    def maximum(self, a: Scalar, b: Scalar) -> Scalar:
        """Elementwise maximum."""

    @abstractmethod
    def is_finite(self, s: Scalar) -> Scalar:
        """Whether the scalar ``s`` is finite (a boolean scalar tensor)."""

    @abstractmethod
    def where(self, pred: Scalar, a: Scalar, b: Scalar) -> Scalar:
        """``a`` where ``pred`` else ``b``, elementwise."""

    # -- selection -------------------------------------------------------------------------
    @abstractmethod
    def topk_abs(self, x: Tensor, k: int) -> Tensor:
        """Indices (int64) of the ``k`` elements of largest magnitude, exact."""

    @abstractmethod
    def min_abs(self, x: Tensor) -> Scalar:
        """The smallest ``|x|`` of a non-empty ``x``."""

    @abstractmethod
    def kth_largest(self, x: Tensor, k: int) -> Scalar:
        """The ``k``-th largest value of ``x`` (1-based), exact."""

    @abstractmethod
    def strided_sample(self, x: Tensor, offset: Any, stride: int, block: int = 1) -> Tensor:
        """The elements of blocks ``offset, offset + stride, ...`` of ``x`` cut into blocks of
        ``block`` elements (whole blocks only); with ``block=1``, ``x[offset::stride]``."""

    @abstractmethod
    def block_abs_max(self, x: Tensor, block: int) -> Tensor:
        """Max of ``|x|`` over consecutive blocks of ``block`` elements (last one may be short)."""

    @abstractmethod
    def block_abs_sum(self, x: Tensor, block: int) -> Tensor:
        """Sum of ``|x|`` over consecutive blocks of ``block`` elements (last one may be short),
        in ``x``'s dtype. Accumulate in float64: each framework sums in its own order, and a
        float64 sum rounded once to float32 agrees across frameworks where float32 sums do not."""

    @abstractmethod
    def block_sum(self, x: Tensor, block: int) -> Tensor:
        """Sum of ``x`` over consecutive blocks of ``block`` elements (``numel(x)`` a multiple
        of ``block``), in float32 (float64 for a float64 ``x``)."""

    @abstractmethod
    def repeat_blocks(self, values: Tensor, block: int, n: int) -> Tensor:
        """``values[i // block]`` for ``i`` in ``range(n)``: one value per block, expanded."""

    @abstractmethod
    def repeat_each(self, values: Tensor, counts: Tensor, n: int) -> Tensor:
        """``values[i]`` repeated ``counts[i]`` times, in order (``counts``: int64, summing to
        ``n``, known when the graph is built): one value per segment of a bucket, expanded."""

    @abstractmethod
    def gather_blocks(self, x: Tensor, blocks: Tensor, block: int) -> Tensor:
        """The elements of the listed blocks (int64 block numbers), concatenated: entry
        ``i * block + j`` is ``x[blocks[i] * block + j]``, NaN past the end of ``x``."""

    def sizes_cost_a_wait(self, x: Tensor) -> bool:
        """Whether reading a size that depends on the data of ``x`` (a count, the length of
        :meth:`nonzero`'s result) makes the host wait for ``x``'s device, as on a GPU: the
        selections then take steps of fixed sizes (``selection.select_by_blocks``)."""
        return False

    def defers_checks(self, x: Tensor) -> bool:
        """Whether checks and finiteness flags on ``x``'s device are left for the caller to
        read once at the end of a step (an adapter's engine that asked for it, where sizes
        cost a wait): failed checks then raise there, a step that is not finite still hands
        back its new memories (the caller drops them), and no method branches on a flag."""
        return False

    def positions_at_least(self, x: Tensor, threshold: Scalar) -> Tensor:
        """Positions (int64, ascending) of the elements ``>= threshold``. A composition; an
        adapter may replace it with a kernel, as :meth:`collect_at_least`."""
        return self.nonzero(self.greater_equal(x, threshold))

    def collect_at_least(self, x: Tensor, blocks: Tensor, block: int,
                         threshold: Scalar) -> Tuple[Tensor, Tensor]:
        """(positions, magnitudes) of the entries with ``|x| >= threshold`` inside the listed
        blocks (int64 block numbers, ascending), in ascending order. This composition of the
        primitives is the reference; an adapter may replace it with a fused kernel."""
        magnitudes = self.abs(self.gather_blocks(x, blocks, block))
        keep = self.nonzero(self.greater_equal(magnitudes, threshold))
        positions = self.gather(blocks, keep // block) * block + keep % block
        return positions, self.gather(magnitudes, keep)

    def count_at_least(self, x: Tensor, blocks: Tensor, block: int, threshold: Scalar) -> Scalar:
        """How many entries :meth:`collect_at_least` would return, without collecting them
        where an adapter has a kernel for it (:meth:`counts_without_collecting`)."""
        return self.size(self.collect_at_least(x, blocks, block, threshold)[0])

    def counts_without_collecting(self, x: Tensor) -> bool:
        """Whether :meth:`count_at_least` on ``x`` costs less than collecting: else a count is
        taken from a collection, which a later pick at the same threshold reuses."""
        return False

    # -- passes over a whole gradient -------------------------------------------------------
    # Each is a composition of the primitives: the reference, which an adapter may replace with
    # a kernel that reads its inputs once (horovod_dgc/torch/kernels/streaming.c).
    def all_finite(self, x: Tensor) -> Scalar:
        """Whether every element of ``x`` is finite: its float32 sum is (a NaN or Inf makes it
        NaN or Inf; finite gradients do not reach float32's range)."""
        return self.is_finite(self.sum(x))

    def block_stat(self, x: Tensor, block: int, stat: Optional[str]) -> Optional[Tensor]:
        """:meth:`block_abs_max` (``stat="max"``) or :meth:`block_abs_sum` (``"sum"``) of
        ``x`` over blocks of ``block`` elements; None for ``stat=None`` or ``block`` 0."""
        if stat is None or not block:
            return None
        return self.block_abs_max(x, block) if stat == "max" else self.block_abs_sum(x, block)

    def takes_pieces(self, like: Tensor) -> bool:
        """Whether the memories' passes read a bucket's gradients like ``like`` as
        :class:`Pieces`, where they lie (an adapter's kernel), so that a caller need not copy
        them into the bucket's buffer first; anything else gathers them."""
        return False

    def gathered(self, grad: Any) -> Tensor:
        """A gradient given as :class:`Pieces` in its flat buffer (written there where the
        framework allows); any other gradient as it is."""
        if not isinstance(grad, Pieces):
            return grad
        parts, end = [], 0
        for part, offset in zip(grad.parts, grad.offsets):
            if offset > end:
                parts.append(self.zeros(offset - end, self.dtype(part), like=part))
            parts.append(part)
            end = offset + self.numel(part)
        if self.numel(grad.flat) > end:
            parts.append(self.zeros(self.numel(grad.flat) - end, self.dtype(grad.flat), like=grad.flat))
        return self.concat(parts)

    def accumulate(self, memory: Tensor, grad: Tensor, grad_scale: Scalar = 1.0,
                   out: Optional[Tensor] = None, block: int = 0, stat: Optional[str] = None,
                   bound: Bound = None, capacity: int = 0
                   ) -> Tuple[Tensor, Optional[Tensor], Scalar, Optional[Candidates]]:
        """Error feedback's ``memory + grad * grad_scale`` (as :meth:`add`, ``out`` included),
        its :meth:`block_stat`, whether ``grad`` is finite, and with ``stat="max"`` the
        :meth:`candidates` of the sum at ``bound`` (None without a bound). ``grad`` may be
        :class:`Pieces`, as in :meth:`momentum_accumulate`."""
        if bound is not None and stat != "max":
            raise ValueError("accumulate collects candidates only beside block maxima")
        grad = self.gathered(grad)
        total = self.add(memory, grad, 1.0, grad_scale, out=out)
        stats = self.block_stat(total, block, stat)
        return total, stats, self.all_finite(grad), self.candidates(total, stats, block, bound, capacity)

    def momentum_step(self, momentum: Tensor, grad: Tensor, m: float, grad_scale: Scalar,
                      nesterov: bool, out: Optional[Tensor] = None) -> Tensor:
        """``u' = m * u + grad_scale * g`` (Nesterov: ``m * (u + grad_scale * g)``), as
        :meth:`add`."""
        beta = grad_scale * m if nesterov else grad_scale
        return self.add(momentum, grad, m, beta, out=out)

    def momentum_accumulate(self, momentum: Tensor, velocity: Tensor, grad: Tensor, m: float,
                            grad_scale: Scalar, nesterov: bool,
                            outs: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
                            block: int = 0, bound: Bound = None, capacity: int = 0
                            ) -> Tuple[Tensor, Tensor, Optional[Tensor], Scalar, Optional[Candidates]]:
        """DGC's momentum correction: ``u' =`` :meth:`momentum_step`, ``v' = v + u'``
        (Nesterov: ``v + u' + grad_scale * g``); returns ``u'``, ``v'`` (``outs``: storage for
        them, as :meth:`add`'s ``out``), :meth:`block_abs_max` of ``v'`` over blocks of
        ``block`` (None for 0), whether ``grad`` is finite, and the :meth:`candidates` of
        ``v'`` at ``bound`` holding at most ``capacity`` entries (None without a bound).
        ``grad`` may be :class:`Pieces` (a bucket's members where they lie)."""
        grad = self.gathered(grad)
        u = self.momentum_step(momentum, grad, m, grad_scale, nesterov, out=outs[0])
        v = self.add(velocity, u, out=outs[1])
        if nesterov:
            v = self.scale_add(v, 1.0, grad, grad_scale)
        maxima = self.block_stat(v, block, "max")
        return u, v, maxima, self.all_finite(grad), self.candidates(v, maxima, block, bound, capacity)

    def candidates(self, x: Tensor, block_max: Optional[Tensor], block: int, bound: Bound,
                   capacity: int) -> Optional[Candidates]:
        """:class:`Candidates` of ``x`` at ``bound`` (compared in ``x``'s dtype; a number, or
        :class:`BlockBounds`), found through its ``block_max`` over blocks of ``block``; None
        without a bound or blocks."""
        if bound is None or block_max is None:
            return None
        if not isinstance(bound, BlockBounds):
            blocks = self.positions_at_least(block_max, bound)
            positions, magnitudes = self.collect_at_least(x, blocks, block, bound)
            count = reached = self.size(positions)
        else:
            blocks = self.nonzero(self.greater_equal(block_max, bound.values))
            magnitudes = self.abs(self.gather_blocks(x, blocks, block))
            reach = self.repeat_blocks(self.gather(bound.values, blocks), block, self.numel(magnitudes))
            keep = self.nonzero(self.greater_equal(magnitudes, reach))
            held = self.gather(blocks, keep // block)
            positions = held * block + keep % block
            magnitudes = self.gather(magnitudes, keep)
            count = self.size(positions)
            reached = self.scatter_add(self.zeros(self.numel(block_max), "int64", like=positions), held,
                                       self.ones(count, "int64", like=positions))
        return self.cond(count > capacity,
                         lambda: Candidates(self.slice(positions, 0, 0), self.slice(magnitudes, 0, 0),
                                            reached, bound),
                         lambda: Candidates(positions, magnitudes, reached, bound))

    def sign_compress(self, x: Tensor, scales: Tensor, block: int, length: int) -> Tuple[Tensor, Tensor]:
        """Blocksign's compression of ``x`` zero-padded to ``length`` entries (a multiple of
        8): the packed signs (:meth:`pack_signs`) and the residual ``x - C(x)`` over ``x``'s
        entries, ``C(x)_i = scales[i // block] * sign(x_i)``, ``sign(0) = +1``. May overwrite
        ``x``."""
        n = self.numel(x)
        packed = self.pack_signs(self.pad(x, length))
        decoded = self.sign_decode(packed, scales, block, n, self.dtype(x))
        return packed, self.scale_add(x, 1.0, decoded, -1.0)

    def sign_decode(self, packed: Tensor, scales: Tensor, block: int, n: int, dtype: str,
                    add_to: Optional[Tensor] = None) -> Tensor:
        """``scales[i // block] * (+1 where bit i of packed is set, else -1)`` for ``i < n``,
        in ``dtype``; added to ``add_to`` when given (which may be overwritten)."""
        signs = self.slice(self.unpack_signs(packed, dtype), 0, n)
        decoded = self.multiply(signs, self.repeat_blocks(self.cast(scales, dtype), block, n))
        return decoded if add_to is None else self.scale_add(add_to, 1.0, decoded)

    def sign_decode_all(self, messages: Sequence[Tuple[Tensor, Tensor, int, int]],
                        dtype: str) -> Tensor:
        """The concatenation of :meth:`sign_decode` of each (packed, scales, block, n) in
        ``messages``. A composition; an adapter may decode into one tensor instead."""
        return self.concat([self.sign_decode(packed, scales, block, n, dtype)
                            for packed, scales, block, n in messages])

    def differences(self, x: Tensor) -> Tensor:
        """``x[i + 1] - x[i]`` for every i: one entry fewer than ``x``."""
        n = self.numel(x) - 1
        return self.add(self.slice(x, 1, n), self.slice(x, 0, n), 1, -1)

    @abstractmethod
    def nonzero(self, mask: Tensor) -> Tensor:
        """Positions (int64) where the boolean ``mask`` is true, ascending."""

    @abstractmethod
    def searchsorted(self, ascending: Tensor, bounds: Sequence[int]) -> Tensor:
        """For each of ``bounds``, how many entries of the 1-D ``ascending`` are below it
        (int64, one per bound)."""

    @abstractmethod
    def greater_equal(self, x: Tensor, threshold: Scalar) -> Tensor:
        """Boolean mask ``x >= threshold``."""

    @abstractmethod
    def size(self, x: Tensor) -> Scalar:
        """Length of a 1-D tensor whose length depends on data (int64 scalar)."""

    @abstractmethod
    def gather(self, x: Tensor, indices: Tensor) -> Tensor:
        """``x[indices]``."""

    @abstractmethod
    def scatter_sub(self, out: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """``out[indices] -= values`` for unique indices (may overwrite ``out``)."""

    @abstractmethod
    def scatter_zero(self, out: Tensor, indices: Tensor) -> Tensor:
        """``out[indices] = 0`` (may overwrite ``out``)."""

    @abstractmethod
    def scatter_add(self, out: Tensor, indices: Tensor, values: Tensor) -> Tensor:
        """``out[indices] += values``; repeated indices are summed (may overwrite ``out``)."""

    def encode_message(self, layout: Any, header: Sequence[Any], positions: Tensor, count: Any,
                       values: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
        """A kernel's whole encode of one sparse message (``layout``: a
        ``wire.MessageLayout``): the message bytes and the values receivers will decode, as
        ``MessageLayout.encode``'s composition computes them. None where the adapter has no
        such kernel or the kernel does not take these inputs: the composition then runs."""
        return None

    def encode_runs(self, layouts: Sequence[Any], headers: Sequence[Sequence[Any]], positions: Tensor,
                    starts: Tensor, source: Tensor, source_positions: Tensor,
                    bases: Sequence[int]) -> Optional[Tuple[Tensor, Tensor]]:
        """A kernel's encode of one message per run of ``positions`` (run j:
        ``positions[starts[j]:starts[j + 1]]``, ascending, sent less ``bases[j]``, whose values are
        ``source[source_positions[starts[j]:starts[j + 1]]]``; ``layouts[j]``'s message with
        ``headers[j]`` but for the count word, the run's length): the messages laid end to end
        and the values receivers will decode in ``positions``' order, as ``wire.encode_runs``'
        composition computes them, with the runs' lengths left where they are. None where the
        adapter has no such kernel or it does not take these inputs: the composition then
        runs."""
        return None

    def check_headers(self, data: Tensor, expected: Sequence[Tuple[Any, Any]],
                      step: Any) -> Optional[Tuple[Tensor, Tensor, Scalar]]:
        """A kernel's check of every header of ``data``, one message per entry of ``expected``
        ((layout, sender) pairs) laid end to end: (each message's flags word, each one's count
        word, whether every header is as expected), as ``wire.receive``'s composition computes
        them. None where the adapter has no such kernel or it does not take these messages:
        the composition then runs."""
        return None

    def decode_positions(self, data: Tensor, layout: Any, sender: int,
                         step: Any) -> Optional[Tuple[Tensor, Tensor]]:
        """A kernel's check and decode of one message of ``layout`` from ``sender``: (its
        ``capacity`` positions, 0 past its count; its flags word), as ``wire.receive``,
        ``MessageLayout.decode`` and ``wire.checked_positions`` compose them. None where the
        adapter has no such kernel or the message is not as expected: the composition then
        runs, and names any problem."""
        return None

    def decode_received(self, data: Tensor, expected: Sequence[Tuple[Any, Any]], step: Any,
                        dtypes: Sequence[str]) -> Optional[Tuple[Tensor, Tensor, Optional[Tensor], Tensor]]:
        """A kernel's check and decode of one message per entry of ``expected`` ((layout,
        sender) pairs, ``wire.MessageLayout`` layouts): (each message's flags word; every
        message's ``capacity`` positions and its values in ``dtypes[m]`` (None for positions
        only), both 0 past its count, message after message; each message's count), as
        ``wire.decode_composed`` computes them. None where the adapter has no such kernel or
        it does not take these messages: the composition then runs, and names any problem."""
        return None

    def decode_sums(self, data: Tensor, layouts: Sequence[Any], world_size: int, step: Any,
                    outs: Sequence[Tensor], scale: float) -> Optional[Tensor]:
        """A kernel's whole decode of an allgather of sparse messages (``data``: each rank's
        messages for ``layouts``, ``wire.MessageLayout`` objects, rank after rank): each
        ``outs[t]`` overwritten with ``scale`` times the sum of tensor t's messages, and each
        message's flags word returned, as ``SparseMethod.decompress``'s composition of
        ``wire.receive``, the codings and :meth:`sum_sparse` computes them. None where the
        adapter has no such kernel, or where the messages are not what the kernel expects:
        the composition then runs, and names any malformed message."""
        return None

    def top_of_segments(self, positions: Tensor, magnitudes: Tensor, starts: Tensor, counts: Tensor,
                        ks: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """A kernel's selection of each segment's ``ks[s]`` largest ``magnitudes`` (float32)
        among the candidates ``starts[s] .. starts[s] + counts[s] - 1`` (positions ascending,
        segments in order): (their positions, ascending, ties at the ``ks[s]``-th largest going
        to the lowest; that ``ks[s]``-th largest, one per segment). None where the adapter has
        no such kernel: ``bucket.select_candidates``' sort then runs."""
        return None

    def magnitude_keys(self, x: Tensor, base: Tensor, real: Any) -> Optional[Tensor]:
        """A kernel's sort keys of ``x``'s magnitudes (int64, one per entry): ``base`` less one
        more than the int64 widening of ``|x|``'s float32 bits (which order as the magnitudes
        do) where ``real`` (a bool tensor, or True for every entry), else ``base``, as
        ``bucket._keys``' composition computes them. None where the adapter has no such kernel
        or it does not take these tensors: the composition then runs."""
        return None

    def block_keys(self, x: Tensor, blocks: Tensor, block: int, slot_offset: Tensor, slot_last: Tensor,
                   slot_base: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """A kernel's positions and sort keys of the entries of ``x``'s chosen blocks
        (``blocks``, int64 block numbers of ``block`` entries): slot s holds position
        ``blocks[s // block] * block + slot_offset[s]``, its key :meth:`magnitude_keys` of
        ``x`` there with base ``slot_base[s]``, real where the position is at most
        ``slot_last[s]``, as ``bucket.block_keys``' composition computes them. None where
        the adapter has no such kernel or it does not take these tensors: the composition
        then runs."""
        return None

    def gaussian_thresholds(self, magnitudes: Tensor, starts: Tensor, counts: Tensor, thresholds: Tensor,
                            low: Tensor, high: Tensor, fewest: Tensor, whole: Tensor,
                            adjustments: int) -> Optional[Tensor]:
        """A kernel's Gaussian-k threshold of every segment at once: segment s, whose
        magnitudes (float32) are ``magnitudes[starts[s] : starts[s] + counts[s]]``, starts at
        ``thresholds[s]``, and ``adjustments`` times its count of magnitudes at or above it, if
        outside ``[low[s], high[s]]``, has it raised by ``GAUSSIAN_RAISE_BY`` (above) or lowered
        by ``GAUSSIAN_LOWER_BY`` (below); the result is 0 where ``whole[s]``, else the last
        threshold if it lets ``fewest[s]`` through, else the lowest tried (float32, one per
        segment). None where the adapter has no such kernel: ``bucket.select_gaussian``'s
        composition then runs."""
        return None

    def sum_sparse(self, out: Tensor, messages: Sequence[Tuple[Tensor, Tensor, Scalar]],
                   scale: float) -> Tensor:
        """``out``'s zeros plus, message after message, ``scale * values`` at ``positions``
        (each message: int64 positions ascending, values, and its count; the slots past the
        count are padding, position 0 and value 0), written over ``out`` where the framework
        allows: the average of N ranks' sparse messages. A composition; an adapter may write
        ``out`` once instead of zeroing it and then scattering into it."""
        out = self.zeroed(out)
        for positions, values, _ in messages:
            # Scaled before the sum: sparse products instead of a pass over the dense sum.
            out = self.scatter_add(out, positions, self.scale(self.copy(values), scale))
        return out

    @abstractmethod
    def pad(self, x: Tensor, length: int) -> Tensor:
        """``x`` followed by zeros up to ``length`` elements (``len(x) <= length``)."""

    # -- bytes on the wire -----------------------------------------------------------------
    @abstractmethod
    def to_bytes(self, x: Tensor) -> Tensor:
        """The raw bytes of ``x`` as a uint8 tensor (bit-exact, native byte order)."""

    @abstractmethod
    def from_bytes(self, data: Tensor, dtype: str) -> Tensor:
        """Reinterpret a uint8 tensor as ``dtype`` (its length must be a multiple)."""

    def bitcast(self, x: Tensor, dtype: str) -> Tensor:
        """The bits of ``x`` read as ``dtype``, of the same width (float32 as int32, say)."""
        return self.from_bytes(self.to_bytes(x), dtype)

    @abstractmethod
    def pack_signs(self, x: Tensor) -> Tensor:
        """Bit ``i % 8`` of byte ``i // 8`` is 1 where ``x[i] >= 0`` (``len(x)`` a multiple of 8)."""

    @abstractmethod
    def unpack_signs(self, packed: Tensor, dtype: str) -> Tensor:
        """+1 where the bit is set, -1 elsewhere: the inverse of :meth:`pack_signs`."""

    @abstractmethod
    def pack_bits(self, bits: Tensor) -> Tensor:
        """Bit ``i % 8`` of byte ``i // 8`` is ``bits[i]`` (a boolean or 0/1 tensor whose length
        is a multiple of 8): the uint8 bytes."""

    @abstractmethod
    def unpack_bits(self, packed: Tensor) -> Tensor:
        """The booleans :meth:`pack_bits` packed (8 per byte)."""

    def pack_fields(self, values: Tensor, width: int, n_bytes: int) -> Tensor:
        """``n_bytes`` uint8 holding :meth:`bits_of` ``values`` packed by :meth:`pack_bits`,
        then zeros. A composition; an adapter may write the bytes in one pass instead."""
        return self.pack_bits(self.pad(self.bits_of(values, width), n_bytes * 8))

    def set_bits(self, positions: Tensor, n_bytes: int) -> Tensor:
        """``n_bytes`` uint8 of a bitmap (:meth:`pack_bits`' order) with the bit of every
        position in ``positions`` set. A composition, as :meth:`pack_fields`."""
        counts = self.scatter_add(self.zeros(n_bytes * 8, "int32", like=positions), positions,
                                  self.ones(self.size(positions), "int32", like=positions))
        return self.pack_bits(self.greater_equal(counts, 1))

    def set_bit_positions(self, packed: Tensor, n_bits: int) -> Tensor:
        """Positions (int64, ascending) of the set bits among the first ``n_bits`` that
        :meth:`pack_bits` packed. A composition; an adapter may read the bytes once instead."""
        return self.nonzero(self.slice(self.unpack_bits(packed), 0, n_bits))

    def set_bit_positions_fitted(self, packed: Tensor, n_bits: int, capacity: int) -> Tuple[Tensor, Scalar]:
        """(the first ``capacity`` positions of :meth:`set_bit_positions`, 0 past the last
        one; how many bits are set). A composition; an adapter where sizes cost a wait
        (:meth:`sizes_cost_a_wait`) may find them without reading a count back."""
        positions = self.set_bit_positions(packed, n_bits)
        return self.fit(positions, capacity), self.size(positions)

    def unpack_fields(self, packed: Tensor, width: int, count: int) -> Tensor:
        """The ``count`` non-negative ``width``-bit integers that :meth:`pack_bits` of
        :meth:`bits_of` packed, as int64."""
        return self.from_bits(self.slice(self.unpack_bits(packed), 0, count * width), width)

    def elias_fano_positions(self, lower: Tensor, low_bits: int, upper: Tensor, n_upper_bits: int,
                             capacity: int, count: Scalar, numel: int) -> Tuple[Tensor, Scalar]:
        """(``capacity`` int64 positions, 0 from ``count`` on; whether ``upper`` has exactly
        ``count`` set bits and every position lies in ``[0, numel)``) of an Elias-Fano coding
        (``codecs.EliasFano``): the i-th set bit b among the first ``n_upper_bits`` of ``upper``
        and the i-th ``low_bits``-bit field of ``lower`` give ``((b - i) << low_bits) + field``.
        A composition; an adapter may read the bytes once instead."""
        set_bits, n_set = self.set_bit_positions_fitted(upper, n_upper_bits, capacity)
        consistent = self.equal(n_set, count)
        slots = self.arange(capacity, like=set_bits)
        high = self.add(set_bits, slots, 1, -1)
        if low_bits:
            high = self.add(high, self.unpack_fields(lower, low_bits, capacity), 2 ** low_bits, 1)
        positions = self.where(self.greater_equal(slots, count), 0, high)
        return positions, self.where(consistent, self.all_within(positions, 0, numel - 1), False)

    def elias_fano_rows(self, lower: Tensor, low_bits: int, upper: Tensor, n_upper_bits: int,
                        capacity: int, rows: int) -> Tuple[Tensor, Tensor]:
        """:meth:`elias_fano_positions` of ``rows`` codings at once, each part holding every
        row's bytes one row after another: (``rows * capacity`` int64, row after row, where
        slot i of a row holds ``((b - i) << low_bits) + field_i`` for its i-th set bit b
        among the first ``n_upper_bits`` of its ``upper`` bytes, and ``(-i << low_bits) +
        field_i`` past its last set bit; each row's number of set bits). Set bits past the
        ``capacity``-th are dropped; no count is read back. A composition; an adapter may
        scan each row once instead."""
        bits = self.rows(self.unpack_bits(upper), 0, self.numel(upper) // rows * 8, n_upper_bits, rows)
        marks, found = self.row_set_bits(bits, n_upper_bits, capacity)
        slots = self.arange(rows * capacity, like=marks)
        if rows > 1:  # each slot's number inside its row
            slots = self.add(slots, self.floordiv(slots, capacity), 1, -capacity)
        high = self.add(marks, slots, 1, -1)
        if low_bits:
            fields = self.rows(self.unpack_bits(lower), 0, self.numel(lower) // rows * 8,
                               capacity * low_bits, rows)
            high = self.add(high, self.from_bits(fields, low_bits), 2 ** low_bits, 1)
        return high, found

    def past_counts(self, capacity: int, counts: Tensor, like: Tensor) -> Tensor:
        """For ``len(counts)`` messages of ``capacity`` slots laid end to end, which slots lie
        past their message's count (its padding), as booleans on ``like``'s device."""
        rows = self.numel(counts)
        limits = self.cast(counts, "int64")
        if rows > 1:
            limits = self.repeat_blocks(
                self.add(limits, self.constant([r * capacity for r in range(rows)], "int64", like=like)),
                capacity, rows * capacity)
        return self.greater_equal(self.arange(rows * capacity, like=like), limits)

    def row_set_bits(self, bits: Tensor, row_bits: int, capacity: int) -> Tuple[Tensor, Tensor]:
        """For ``bits`` cut into rows of ``row_bits`` booleans: (``rows * capacity`` int64,
        row after row, where slot i of a row holds the index inside its row of that row's
        i-th set bit, 0 past its last one and set bits past the ``capacity``-th dropped; each
        row's number of set bits). Fixed sizes, no count read back: the rows of N senders'
        bitmaps decoded at once. A composition; an adapter may scan the rows instead."""
        n = self.numel(bits)
        ranks = self.row_cumsum(bits, row_bits)
        slot = self.add(ranks, -1)
        entry = self.arange(n, like=ranks)
        row = self.floordiv(entry, row_bits)
        dump = (n // row_bits) * capacity  # the target of every clear bit and every bit past the capacity
        kept = self.where(self.greater_equal(slot, capacity), dump, self.add(row, slot, capacity, 1))
        target = self.where(bits, kept, dump)
        found = self.scatter_add(self.zeros(dump + 1, "int64", like=ranks), target,
                                 self.add(entry, row, 1, -row_bits))
        return self.slice(found, 0, dump), self.strided_sample(ranks, row_bits - 1, row_bits)

    @abstractmethod
    def bits_of(self, values: Tensor, width: int) -> Tensor:
        """The ``width`` lowest bits of each non-negative int64 of ``values``, lowest first,
        as one flat boolean tensor of ``len(values) * width`` entries."""

    @abstractmethod
    def from_bits(self, bits: Tensor, width: int) -> Tensor:
        """The int64 values whose ``width`` lowest bits :meth:`bits_of` gave."""

    @abstractmethod
    def sort(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(``x`` ascending, the int64 positions it came from); stable: equal entries keep
        their order."""

    @abstractmethod
    def arange(self, n: Scalar, like: Tensor) -> Tensor:
        """``0, 1, ..., n - 1`` as int64 on the device of ``like`` (``n`` may be a run-time
        scalar)."""

    @abstractmethod
    def floordiv(self, x: Tensor, divisor: int) -> Tensor:
        """``x // divisor`` for non-negative integers."""

    @abstractmethod
    def round(self, x: Tensor) -> Tensor:
        """Each element rounded to the nearest integer (halves to even), same dtype."""

    @abstractmethod
    def fit(self, data: Tensor, length: int) -> Tensor:
        """``data`` cut or zero-padded to ``length`` elements, with that length known when the
        graph is built; the caller checks the true length separately."""

    # -- checks ------------------------------------------------------------------------------
    @abstractmethod
    def equal(self, a: Scalar, b: Scalar) -> Scalar:
        """Whether the integer scalars ``a`` and ``b`` are equal, whatever their dtypes."""

    @abstractmethod
    def all_within(self, x: Tensor, low: Any, high: Any) -> Scalar:
        """Whether ``low <= x <= high`` holds for every element (a boolean scalar); the bounds
        are tensors like ``x`` or numbers."""

    @abstractmethod
    def check(self, pred: Scalar, error: Exception) -> None:
        """Raise ``error`` when the boolean scalar ``pred`` is false (TensorFlow: a graph
        assertion carrying the error's message)."""

    @abstractmethod
    def verify(self, pred: Scalar, inputs: Sequence[Any], explain: Callable[..., None],
               result: Tensor) -> Tensor:
        """``result``, once the boolean scalar ``pred`` is known to hold. When it does not,
        ``explain`` is called with the values of ``inputs`` (tensors or Python numbers) as
        Python lists and numbers, and raises the error that says what is wrong (TensorFlow: at
        run time, failing the step before anything computed from ``result`` runs). Costs one
        comparison when ``pred`` holds; ``explain`` runs only on failure."""

    # -- control flow ----------------------------------------------------------------------
    @abstractmethod
    def while_loop(self, cond: Callable[..., Scalar], body: Callable[..., Tuple],
                   loop_vars: Tuple, max_iterations: int) -> Tuple:
        """Run ``loop_vars = body(*loop_vars)`` while ``cond(*loop_vars)``, at most
        ``max_iterations`` times."""

    @abstractmethod
    def cond(self, pred: Scalar, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` if ``pred`` else ``false_fn()``; only the branch taken runs."""
