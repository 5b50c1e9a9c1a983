"""TensorFlow implementation of the core's :class:`~horovod_dgc.core.ops.TensorOps`.

Every method builds TensorFlow ops, so the core runs eagerly and inside ``tf.function``, where
Horovod always calls compressors. Updates are functional: an ``out`` argument is never
modified, a new tensor is returned. Control flow is plain Python when executing eagerly and
``tf.while_loop`` / ``tf.cond`` in a graph; checks that need Python at run time go through
``tf.py_function`` and fail as graph assertions that carry the error's message.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..core.ops import Scalar, TensorOps

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
          "float64": tf.float64, "int32": tf.int32, "int64": tf.int64, "int8": tf.int8,
          "uint8": tf.uint8, "bool": tf.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_PYTHON_NUMBERS = (bool, int, float)
_BIT_SHIFTS = tuple(range(8))


def dtype_name(dtype: tf.DType) -> str:
    """The core's name of a TensorFlow dtype (``"other"`` for dtypes the core does not know)."""
    return DTYPE_NAMES.get(tf.as_dtype(dtype).base_dtype, "other")


def checked_call(fn: Callable[..., None], inputs: Sequence[tf.Tensor]) -> Optional[tf.Operation]:
    """Run ``fn`` on the values of ``inputs`` (as eager tensors) when they exist.

    Executing eagerly, that is now, and an exception it raises propagates (None is returned).
    In a graph, it runs with the graph and an exception fails the step as an assertion whose
    message is ``"<ErrorType>: <message>"`` (a readable error, not the check's stack trace);
    the assertion is returned so that results can wait for it.
    """
    if tf.executing_eagerly():
        fn(*inputs)
        return None

    def explain(*values: tf.Tensor) -> str:
        try:
            fn(*values)
        except Exception as error:  # any failure of the check is reported, by type and message
            return f"{type(error).__name__}: {error}"
        return ""

    text = tf.py_function(explain, list(inputs), tf.string)
    return tf.debugging.Assert(tf.equal(text, ""), [text])


class _UntypedChoice:
    """``where(pred, a, b)`` of two Python numbers. TensorFlow does not promote dtypes, so
    the choice becomes a tensor of the dtype of the tensor it is combined with."""

    def __init__(self, pred: tf.Tensor, a: float, b: float):
        self.pred, self.a, self.b = pred, a, b


def _convert_choice(value: _UntypedChoice, dtype=None, name=None, as_ref=False) -> tf.Tensor:
    dtype = dtype or tf.float32
    return tf.where(value.pred, _constant(value.a, dtype), _constant(value.b, dtype))


tf.register_tensor_conversion_function(_UntypedChoice, _convert_choice)


# Per graph: (dtype, repr(value)) -> a weak reference to the constant (a strong one would
# keep the graph, a finished trace, alive).
_CONSTANTS: "weakref.WeakKeyDictionary[tf.Graph, Dict[Tuple[tf.DType, str], weakref.ref]]" = \
    weakref.WeakKeyDictionary()


def _constant(value: Any, dtype: tf.DType) -> tf.Tensor:
    """``value`` (a Python number, or a tuple of them) as a constant of ``dtype``: in a graph,
    one op per graph, value and dtype, however often it is asked for. Every compressed
    tensor's exchange is traced into the training step, and a third of its ops were repeated
    constants (shapes, axes, zeros, thresholds)."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(value, dtype)
    graph = tf.compat.v1.get_default_graph()
    constants = _CONSTANTS.setdefault(graph, {})
    key = (dtype, repr(value))  # repr tells -0.0 from 0.0 and 1 from True
    known = constants.get(key)
    tensor = None if known is None else known()
    if tensor is None:
        # Built inside a control-dependency block, it would carry the block's dependencies
        # to every later use.
        with graph.control_dependencies(None):
            tensor = tf.convert_to_tensor(value, dtype)
        constants[key] = weakref.ref(tensor)
    return tensor


def _tensor(value: Any, dtype: tf.DType) -> tf.Tensor:
    """``value`` (tensor, Python number or untyped choice) as a tensor of ``dtype``."""
    if isinstance(value, tf.Tensor):
        return value if value.dtype == dtype else tf.cast(value, dtype)
    if isinstance(value, _PYTHON_NUMBERS):
        return _constant(value, dtype)
    return tf.convert_to_tensor(value, dtype)


def _shape(*dims: int) -> tf.Tensor:
    """A static shape, axis or start as an int32 constant."""
    return _constant(dims, tf.int32)


def _zero(dtype: tf.DType) -> tf.Tensor:
    return _constant(False if dtype == tf.bool else 0, dtype)


def _axis(axis: int) -> tf.Tensor:
    return _constant(axis, tf.int32)


def _flat(x: tf.Tensor) -> tf.Tensor:
    return tf.reshape(x, _shape(-1))


def _rows(x: tf.Tensor, width: int) -> tf.Tensor:
    """``x`` as rows of ``width`` elements."""
    return tf.reshape(x, _shape(-1, width))


def _vector(x: tf.Tensor) -> tf.Tensor:
    """A 0-d tensor as a 1-element 1-D one (a run-time shape, start or size)."""
    return tf.expand_dims(x, _axis(0))


def _all_axes(x: tf.Tensor) -> tf.Tensor:
    """Every axis of ``x``, for a reduction to one value."""
    return _constant(tuple(range(x.shape.rank)), tf.int32)


def _column(x: tf.Tensor) -> tf.Tensor:
    """``x[:, None]``."""
    return tf.expand_dims(x, _axis(1))


def _head(x: tf.Tensor, n: int) -> tf.Tensor:
    """The first ``n`` elements of 1-D ``x`` (at least ``n`` of them)."""
    return tf.slice(x, _shape(0), _shape(n))


def _concat(parts: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.concat(list(parts), _axis(0))


def _gather(x: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    return tf.gather(x, indices, axis=_axis(0))


def _iota(n: Any, dtype: tf.DType = tf.int64) -> tf.Tensor:
    """``0, 1, ..., n - 1`` (``n``: a Python int or a 0-d tensor)."""
    return tf.range(_constant(0, dtype), _tensor(n, dtype), _constant(1, dtype))


def _pair(a: Any, b: Any) -> Tuple[tf.Tensor, tf.Tensor]:
    """``a`` and ``b`` as tensors of one dtype: the first tensor's (float32 if neither is)."""
    dtype = next((v.dtype for v in (a, b) if isinstance(v, tf.Tensor)), tf.float32)
    return _tensor(a, dtype), _tensor(b, dtype)


def _promoted(x: tf.Tensor, y: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """``x`` and ``y`` in one dtype, as PyTorch promotes them: the wider one (float32 for
    float16 with bfloat16)."""
    if x.dtype == y.dtype:
        return x, y
    if x.dtype.size == y.dtype.size:
        dtype = tf.float32
    else:
        dtype = x.dtype if x.dtype.size > y.dtype.size else y.dtype
    return _tensor(x, dtype), _tensor(y, dtype)


def _counts_as_float(values: Tuple) -> Tuple:
    """Integer loop variables (counts) as float64: the core compares counts with fractional
    bounds (``c < 2k/3``), which TensorFlow refuses for integer tensors. Exact below 2**53."""
    return tuple(tf.cast(v, tf.float64) if isinstance(v, tf.Tensor) and v.dtype.is_integer else v
                 for v in values)


def _like(values: Tuple, like: Sequence[tf.Tensor]) -> Tuple:
    return tuple(_tensor(v, ref.dtype) for v, ref in zip(values, like))


class TFOps(TensorOps):
    def __init__(self) -> None:
        self._guard_lists: List[List[tf.Operation]] = []
        self._dry_runs = 0

    # -- graph-mode bookkeeping -------------------------------------------------------------
    @contextlib.contextmanager
    def guards(self) -> Iterator[List[tf.Operation]]:
        """Lists the graph-mode checks built inside the block, so that results can be made
        to wait for them (``tf.control_dependencies``)."""
        guards: List[tf.Operation] = []
        self._guard_lists.append(guards)
        try:
            yield guards
        finally:
            self._guard_lists.pop()

    def _guard(self, op: tf.Operation) -> None:
        if self._guard_lists:
            self._guard_lists[-1].append(op)

    @contextlib.contextmanager
    def _dry_run(self) -> Iterator[None]:
        """Inside, checks build nothing: only pure ops, which TensorFlow prunes when unused."""
        self._dry_runs += 1
        try:
            yield
        finally:
            self._dry_runs -= 1

    # -- shape, dtype, construction ---------------------------------------------------------
    def numel(self, x: tf.Tensor) -> int:
        n = x.shape.num_elements()
        if n is None:
            raise ValueError(f"a tensor of shape {x.shape} has no static number of elements")
        return n

    def dtype(self, x: tf.Tensor) -> str:
        return dtype_name(x.dtype)

    def cast(self, x: tf.Tensor, dtype: str) -> tf.Tensor:
        return _tensor(x, DTYPES[dtype])

    def zeros(self, n: int, dtype: str, like: tf.Tensor) -> tf.Tensor:
        target = DTYPES[dtype]
        return tf.fill(_shape(n), _zero(target))

    def zeroed(self, x: tf.Tensor) -> tf.Tensor:
        return tf.zeros_like(x)

    def constants_key(self, like: tf.Tensor) -> Any:
        # A graph's constants belong to it: a table made while tracing one is not another's.
        return type(self), like.device if tf.executing_eagerly() else tf.compat.v1.get_default_graph()

    def constant(self, values: Sequence[Any], dtype: str, like: tf.Tensor) -> tf.Tensor:
        """The Python numbers as one constant, each distinct other value (a tensor) converted
        once (a header's step counter repeats in every message's bounds)."""
        target = DTYPES[dtype]
        if all(isinstance(v, _PYTHON_NUMBERS) for v in values):
            return _constant(tuple(values), target)
        dynamic = list({id(v): v for v in values if not isinstance(v, _PYTHON_NUMBERS)}.values())
        where = {id(v): len(values) + i for i, v in enumerate(dynamic)}
        pool = _concat([_constant(tuple(v if isinstance(v, _PYTHON_NUMBERS) else 0 for v in values), target),
                        tf.stack([_tensor(v, target) for v in dynamic])])
        return _gather(pool, _constant(tuple(where.get(id(v), i) for i, v in enumerate(values)),
                                       tf.int32))

    def ones(self, n: Any, dtype: str, like: tf.Tensor) -> tf.Tensor:
        return tf.fill(_vector(_tensor(n, tf.int32)), _constant(1, DTYPES[dtype]))

    def copy(self, x: tf.Tensor) -> tf.Tensor:
        return tf.identity(x)

    def concat(self, parts: Sequence[tf.Tensor]) -> tf.Tensor:
        return _concat(parts)

    def slice(self, x: tf.Tensor, start: Any, length: Any) -> tf.Tensor:
        if isinstance(start, int) and isinstance(length, int):
            return tf.slice(x, _shape(start), _shape(length))
        bounds = [_vector(_tensor(v, tf.int64)) for v in (start, length)]
        return tf.slice(x, *bounds)

    # -- elementwise arithmetic and reductions ------------------------------------------------
    def scale_add(self, out: tf.Tensor, alpha: Scalar, x: tf.Tensor,
                  beta: Scalar = 1.0) -> tf.Tensor:
        if not (isinstance(alpha, _PYTHON_NUMBERS) and alpha == 1.0):
            out = out * _tensor(alpha, out.dtype)
        # PyTorch computes x * beta in x's dtype, adds in out's (16-bit gradients, float32 memories).
        if isinstance(beta, _PYTHON_NUMBERS) and beta == 1.0:
            result = out + _tensor(x, out.dtype)
        elif isinstance(beta, _PYTHON_NUMBERS) and out.dtype == tf.float32:
            result = self._fused_multiply_add(x, beta, out)
        else:
            result = out + _tensor(x * _tensor(beta, x.dtype), out.dtype)
        if tf.executing_eagerly():
            return result
        # Grappler rewrites a chain of adds (Nesterov's v + u + g) into one AddN that sums in
        # another order; a Snapshot (which forwards its input's buffer) keeps the rounding of
        # PyTorch and of eager execution.
        return tf.raw_ops.Snapshot(input=result)

    @staticmethod
    def _fused_multiply_add(x: tf.Tensor, beta: float, out: tf.Tensor) -> tf.Tensor:
        """``out + x * beta`` rounded once, as PyTorch's ``add_(x, alpha=beta)`` (a fused
        multiply-add) rounds it: the float32 product is exact in float64."""
        beta32 = tf.cast(tf.constant(beta, tf.float32), tf.float64)
        exact = tf.cast(out, tf.float64) + tf.cast(x, tf.float64) * beta32
        return tf.cast(exact, tf.float32)

    def scale(self, out: tf.Tensor, alpha: Scalar) -> tf.Tensor:
        return out * _tensor(alpha, out.dtype)

    def add(self, x: tf.Tensor, y: tf.Tensor, alpha: Scalar = 1.0, beta: Scalar = 1.0,
            out: Optional[tf.Tensor] = None) -> tf.Tensor:
        if isinstance(y, _PYTHON_NUMBERS):
            y = _tensor(y, x.dtype)
        x, y = _promoted(x, y)
        return self.scale_add(x, alpha, y, beta)

    def multiply(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        x, y = _promoted(x, y)
        return x * y

    def sum(self, x: tf.Tensor) -> tf.Tensor:
        x = _at_least_float32(x)
        return tf.reduce_sum(x, _all_axes(x))

    def dot(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return tf.tensordot(_at_least_float32(x), _at_least_float32(y), 1)

    def clamp(self, x: tf.Tensor, bound: float) -> tf.Tensor:
        return tf.clip_by_value(x, -bound, bound)

    def abs(self, x: Any) -> Any:
        return abs(x) if isinstance(x, _PYTHON_NUMBERS) else tf.abs(x)

    def sqrt(self, s: Scalar) -> tf.Tensor:
        return tf.sqrt(tf.convert_to_tensor(s))

    def minimum(self, a: Scalar, b: Scalar) -> tf.Tensor:
        return tf.minimum(*_pair(a, b))

    def maximum(self, a: Scalar, b: Scalar) -> tf.Tensor:
        return tf.maximum(*_pair(a, b))

    def is_finite(self, s: tf.Tensor) -> tf.Tensor:
        return tf.math.is_finite(s)

    def where(self, pred: Scalar, a: Scalar, b: Scalar) -> Any:
        if isinstance(a, _PYTHON_NUMBERS) and isinstance(b, _PYTHON_NUMBERS):
            return _UntypedChoice(pred, a, b)
        return tf.where(pred, *_pair(a, b))

    # -- selection --------------------------------------------------------------------------
    def topk_abs(self, x: tf.Tensor, k: int) -> tf.Tensor:
        return tf.cast(tf.math.top_k(tf.abs(x), k, sorted=False).indices, tf.int64)

    def min_abs(self, x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_min(tf.abs(x), _axis(0))

    def kth_largest(self, x: tf.Tensor, k: int) -> tf.Tensor:
        return tf.reduce_min(tf.math.top_k(x, k, sorted=False).values, _axis(0))

    def rows(self, x: tf.Tensor, start: int, stride: int, length: int, count: int) -> tf.Tensor:
        if count == 1:
            return self.slice(x, start, length)
        span = min(count * stride, self.numel(x) - start)  # the last row may end the tensor
        laid = self.pad(tf.slice(x, _shape(start), _shape(span)), count * stride)
        return _flat(_rows(laid, stride)[:, :length])

    def row_cumsum(self, x: tf.Tensor, row: int) -> tf.Tensor:
        return _flat(tf.cumsum(_rows(tf.cast(x, tf.int64), row), axis=1))

    def strided_sample(self, x: tf.Tensor, offset: Any, stride: int, block: int = 1) -> tf.Tensor:
        """Blocks ``offset::stride`` of ``x``. An offset known only at run time (the step
        counter's, in a graph) gives the ``whole blocks // stride`` blocks every offset has,
        so the sample's length stays static."""
        whole = self.numel(x) // block
        rows = _rows(_head(x, whole * block), block)
        if isinstance(offset, tf.Tensor) and tf.executing_eagerly():
            offset = int(offset)
        if isinstance(offset, int):
            return _flat(rows[offset::stride])
        count = whole // stride
        picked = _gather(rows, _tensor(offset, tf.int64) + _constant(stride, tf.int64) * _iota(count))
        return _flat(picked)

    def block_abs_max(self, x: tf.Tensor, block: int) -> tf.Tensor:
        n = self.numel(x)
        whole = n // block
        # max(max, -min) reads x twice but builds no full-size |x|.
        rows = _rows(_head(x, whole * block), block)
        maxima = tf.maximum(tf.reduce_max(rows, _axis(1)), -tf.reduce_min(rows, _axis(1)))
        if whole * block == n:
            return maxima
        tail = tf.slice(x, _shape(whole * block), _shape(n - whole * block))
        last = tf.maximum(tf.reduce_max(tail, _axis(0), keepdims=True),
                          -tf.reduce_min(tail, _axis(0), keepdims=True))
        return _concat([maxima, last])

    def block_abs_sum(self, x: tf.Tensor, block: int) -> tf.Tensor:
        n = self.numel(x)
        whole = n // block
        magnitudes = tf.cast(tf.abs(x), tf.float64)
        sums = tf.reduce_sum(_rows(_head(magnitudes, whole * block), block), _axis(1))
        if whole * block != n:
            tail = tf.slice(magnitudes, _shape(whole * block), _shape(n - whole * block))
            sums = _concat([sums, tf.reduce_sum(tail, _axis(0), keepdims=True)])
        return tf.cast(sums, x.dtype)

    def block_sum(self, x: tf.Tensor, block: int) -> tf.Tensor:
        return tf.reduce_sum(_rows(_at_least_float32(x), block), _axis(1))

    def repeat_blocks(self, values: tf.Tensor, block: int, n: int) -> tf.Tensor:
        return _head(tf.repeat(values, block), n)

    def repeat_each(self, values: tf.Tensor, counts: tf.Tensor, n: int) -> tf.Tensor:
        return tf.reshape(tf.repeat(values, counts), [n])

    def gather_blocks(self, x: tf.Tensor, blocks: tf.Tensor, block: int) -> tf.Tensor:
        n = self.numel(x)
        offsets = _constant(tuple(range(block)), tf.int64)
        positions = _flat(_column(blocks * _constant(block, tf.int64)) + offsets)
        if n % block == 0:
            return _gather(x, positions)
        values = _gather(x, tf.minimum(positions, _constant(n - 1, tf.int64)))
        return tf.where(positions < _constant(n, tf.int64), values, _constant(float("nan"), x.dtype))

    def nonzero(self, mask: tf.Tensor) -> tf.Tensor:
        return _flat(tf.where(mask))

    def searchsorted(self, ascending: tf.Tensor, bounds: Sequence[int]) -> tf.Tensor:
        found = tf.searchsorted(ascending, tf.constant(bounds, ascending.dtype), side="left")
        return tf.cast(found, tf.int64)

    def greater_equal(self, x: tf.Tensor, threshold: Scalar) -> tf.Tensor:
        return x >= _tensor(threshold, x.dtype)

    def size(self, x: tf.Tensor) -> tf.Tensor:
        return tf.size(x, out_type=tf.int64)

    def gather(self, x: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
        return _gather(x, indices)

    def scatter_sub(self, out: tf.Tensor, indices: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        return tf.tensor_scatter_nd_sub(out, _column(indices), values)

    def scatter_zero(self, out: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
        return tf.tensor_scatter_nd_update(out, _column(indices), tf.zeros_like(indices, out.dtype))

    def scatter_add(self, out: tf.Tensor, indices: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        return tf.tensor_scatter_nd_add(out, _column(indices), values)

    def pad(self, x: tf.Tensor, length: int) -> tf.Tensor:
        if x.shape[0] == length:
            return x
        if x.shape[0] is not None:
            return _concat([x, self.zeros(length - x.shape[0], dtype_name(x.dtype), x)])
        short = _constant(length, tf.int64) - tf.size(x, out_type=tf.int64)
        padded = _concat([x, tf.fill(_vector(short), _zero(x.dtype))])
        return tf.reshape(padded, _shape(length))

    # -- bytes on the wire --------------------------------------------------------------------
    def to_bytes(self, x: tf.Tensor) -> tf.Tensor:
        if x.dtype == tf.uint8:
            return x
        return _flat(tf.bitcast(x, tf.uint8))

    def from_bytes(self, data: tf.Tensor, dtype: str) -> tf.Tensor:
        target = DTYPES[dtype]
        if target == tf.uint8:
            return data
        return tf.bitcast(_rows(data, target.size), target)

    def pack_signs(self, x: tf.Tensor) -> tf.Tensor:
        bits = tf.cast(_rows(x, 8) >= _constant(0, x.dtype), tf.uint8)
        return tf.reduce_sum(tf.bitwise.left_shift(bits, _constant(_BIT_SHIFTS, tf.uint8)), _axis(1))

    def unpack_signs(self, packed: tf.Tensor, dtype: str) -> tf.Tensor:
        target = DTYPES[dtype]
        signs = tf.cast(_flat(_bits_of_bytes(packed)), target)
        return signs * _constant(2, target) - _constant(1, target)

    def pack_bits(self, bits: tf.Tensor) -> tf.Tensor:
        bytes_ = _rows(tf.cast(bits, tf.uint8), 8)
        return tf.reduce_sum(tf.bitwise.left_shift(bytes_, _constant(_BIT_SHIFTS, tf.uint8)), _axis(1))

    def unpack_bits(self, packed: tf.Tensor) -> tf.Tensor:
        return tf.cast(_flat(_bits_of_bytes(packed)), tf.bool)

    def bits_of(self, values: tf.Tensor, width: int) -> tf.Tensor:
        shifts = _constant(tuple(range(width)), tf.int64)
        bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(_column(_tensor(values, tf.int64)), shifts),
                                      _constant(1, tf.int64))
        return tf.cast(_flat(bits), tf.bool)

    def from_bits(self, bits: tf.Tensor, width: int) -> tf.Tensor:
        if width == 0:
            return self.zeros(0, "int64", bits)
        shifts = _constant(tuple(range(width)), tf.int64)
        words = tf.bitwise.left_shift(_rows(tf.cast(bits, tf.int64), width), shifts)
        return tf.reduce_sum(words, _axis(1))

    def sort(self, x: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        order = tf.argsort(x, stable=True)
        return _gather(x, order), tf.cast(order, tf.int64)

    def arange(self, n: Scalar, like: tf.Tensor) -> tf.Tensor:
        return _iota(n)

    def floordiv(self, x: tf.Tensor, divisor: int) -> tf.Tensor:
        return tf.math.floordiv(x, tf.cast(divisor, x.dtype))

    def round(self, x: tf.Tensor) -> tf.Tensor:
        return tf.round(x)

    def fit(self, data: tf.Tensor, length: int) -> tf.Tensor:
        """Not ``tf.reshape(data, [length])``: Horovod's collectives are stateless ops to
        TensorFlow, and Grappler's shape inference takes such a reshape, even in a branch not
        taken, as a fact about the collective's output and folds the size check away."""
        size = tf.size(data)
        limit = _constant(length, tf.int32)
        head = tf.slice(data, _shape(0), _vector(tf.minimum(size, limit)))
        short = _vector(tf.maximum(limit - size, _constant(0, tf.int32)))
        return tf.reshape(_concat([head, tf.fill(short, _zero(data.dtype))]), _shape(length))

    def equal(self, a: Scalar, b: Scalar) -> tf.Tensor:
        return tf.equal(_tensor(a, tf.int64), _tensor(b, tf.int64))

    def all_within(self, x: tf.Tensor, low: Any, high: Any) -> tf.Tensor:
        within = tf.logical_and(x >= _tensor(low, x.dtype), x <= _tensor(high, x.dtype))
        return tf.reduce_all(within, _all_axes(within))

    def check(self, pred: Scalar, error: Exception) -> None:
        if isinstance(pred, bool) or tf.executing_eagerly():
            if not bool(pred):
                raise error
        elif not self._dry_runs:
            self._guard(tf.debugging.Assert(pred, [f"{type(error).__name__}: {error}"]))

    def verify(self, pred: Scalar, inputs: Sequence[Any], explain: Callable[..., None],
               result: tf.Tensor) -> tf.Tensor:
        def explained(*values: Any) -> None:
            explain(*[_host_value(v) for v in values])
            raise AssertionError("a check failed and its explanation raised nothing")

        if isinstance(pred, bool) or tf.executing_eagerly():
            if not bool(pred):
                explained(*inputs)
            return result
        if self._dry_runs:
            return result
        tensors = [tf.convert_to_tensor(x) for x in inputs]

        def failing() -> tf.Tensor:
            with tf.control_dependencies([checked_call(explained, tensors)]):
                return tf.constant(False)

        guard = tf.cond(pred, lambda: tf.constant(True), failing)
        self._guard(guard.op)
        with tf.control_dependencies([guard]):
            return tf.identity(result)

    def while_loop(self, cond: Callable[..., Scalar], body: Callable[..., Tuple],
                   loop_vars: Tuple, max_iterations: int) -> Tuple:
        loop_vars = tuple(tf.convert_to_tensor(v) for v in loop_vars)
        if tf.executing_eagerly():
            for _ in range(max_iterations):
                if not bool(cond(*_counts_as_float(loop_vars))):
                    break
                loop_vars = _like(body(*_counts_as_float(loop_vars)), loop_vars)
            return loop_vars
        return tuple(tf.while_loop(lambda *v: cond(*_counts_as_float(v)),
                                   lambda *v: _like(body(*_counts_as_float(v)), v),
                                   loop_vars, maximum_iterations=max_iterations))

    def cond(self, pred: Scalar, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``tf.cond`` in a graph. The core memoises tensors between calls (its candidate
        filter); a tensor built inside one branch cannot be used by the other, so the false
        branch first runs in the enclosing graph, where what it memoises is visible to both
        branches (what neither branch uses is pruned by TensorFlow). Python numbers a branch
        returns become tensors of the dtype the other branch returns there; None where both
        branches return None stays None."""
        if isinstance(pred, bool) or tf.executing_eagerly():
            return true_fn() if bool(pred) else false_fn()
        with self._dry_run():
            skipped = false_fn()
        like = tf.nest.flatten(skipped)
        holes = [value is None for value in like]

        def normalised(fn: Callable[[], Any]) -> Callable[[], List[tf.Tensor]]:
            def branch() -> List[tf.Tensor]:
                out = tf.nest.flatten(fn())
                if [value is None for value in out] != holes:
                    raise ValueError("the branches of a cond return None at different places")
                like[:] = [v if h else _as_tensor_like(v, l) for v, l, h in zip(out, like, holes)]
                return [v for v, h in zip(like, holes) if not h]
            return branch

        results = iter(tf.cond(pred, normalised(true_fn), normalised(false_fn)))
        return tf.nest.pack_sequence_as(skipped, [None if h else next(results) for h in holes])


def _bits_of_bytes(packed: tf.Tensor) -> tf.Tensor:
    """Each byte's 8 bits, lowest first, as rows of uint8 0 or 1."""
    shifted = tf.bitwise.right_shift(_column(packed), _constant(_BIT_SHIFTS, tf.uint8))
    return tf.bitwise.bitwise_and(shifted, _constant(1, tf.uint8))


def _at_least_float32(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x


def _host_value(value: Any) -> Any:
    """A tensor's value as a Python list or number; anything else as it is."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value.numpy().tolist()
    return value


def _as_tensor_like(value: Any, like: Any) -> tf.Tensor:
    if isinstance(value, tf.Tensor):
        return value
    if isinstance(like, tf.Tensor):
        return _tensor(value, like.dtype)
    return tf.convert_to_tensor(value)
