"""A memory's pass in one kernel on a GPU (Triton): the GPU's twin of the C kernels'
``error_feedback`` and ``momentum_correction``.

The core's composition of that pass (``TensorOps.accumulate`` and ``momentum_accumulate``)
is five to eight framework kernels on a GPU, each reading or writing the whole tensor: the
sum, the block maxima of the new memory, and the finiteness check are separate passes. This
kernel reads the gradient and the memories once, writes the new memories once, and hands
back every block's largest magnitude and whether the gradient was finite, the inputs of the
fixed-size selection (``selection.select_by_blocks``), without a wait for the host.

It is used for CUDA tensors when Triton imports, the grad scale is a Python number and no
candidate bound is asked for (a GPU's engine passes none); everything else takes the
composition. ``tests/test_triton_memory.py`` checks the kernel against the equations, and
``tests/test_device_torch.py`` whole runs on CUDA against the CPU's. Arithmetic is in float32
whatever the tensors' dtypes; results are stored in the memories' dtype. The finiteness flag
is per entry, where the composition's is the finiteness of a float32 sum.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: TorchOps keeps the composition
    triton = None

# Entries one program covers when no block maxima are asked for, and block rows per program
# otherwise (about 2,048 entries a program: enough work per program to hide its start).
FLAT_BLOCK = 2048
ENTRIES_PER_PROGRAM = 2048

ERROR_FEEDBACK, MOMENTUM, NESTEROV = 0, 1, 2
# Triton reads this switch when it is imported: in a process started under it, kernels run
# on CPU tensors through Triton's interpreter (the CPU tests' way to run this kernel).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def launchable(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel may take these tensors: Triton imports, and they are
    contiguous, on one CUDA device (or on the CPU under Triton's interpreter, which the CPU
    tests use)."""
    if triton is None or not all(t.is_contiguous() for t in tensors):
        return False
    return len({t.device for t in tensors}) == 1 and (tensors[0].device.type == "cuda" or INTERPRETED)


def supports(grad: torch.Tensor, *memories: Optional[torch.Tensor]) -> bool:
    """Whether the kernel takes these tensors: :func:`launchable`, floating point but not
    float64, and a gradient with entries."""
    tensors = [grad, *[m for m in memories if m is not None]]
    return (grad.numel() > 0 and all(t.is_floating_point() and t.dtype != torch.float64 for t in tensors)
            and launchable(*tensors))


if triton is not None:
    @triton.jit
    def _memory_pass(grad, momentum, velocity, momentum_out, velocity_out, maxima, finite,
                     numel, scale, m, MODE: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, MAXIMA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        at = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = at < numel
        g = tl.load(grad + at, mask=inside, other=0.0).to(tl.float32)
        v = tl.load(velocity + at, mask=inside, other=0.0).to(tl.float32)
        if MODE == 0:
            v = v + g * scale
        else:
            u = tl.load(momentum + at, mask=inside, other=0.0).to(tl.float32)
            if MODE == 2:
                u = u * m + g * (scale * m)
                v = v + u + g * scale
            else:
                u = u * m + g * scale
                v = v + u
            tl.store(momentum_out + at, u, mask=inside)
        tl.store(velocity_out + at, v, mask=inside)
        if MAXIMA:
            tl.store(maxima + row, tl.max(tl.abs(v), axis=1), mask=row * BLOCK < numel)
        bad = tl.sum(tl.sum(((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32), axis=1), axis=0)
        if bad > 0:
            tl.store(finite, 0)


def memory_pass(grad: torch.Tensor, scale: float, velocity: torch.Tensor,
                velocity_out: Optional[torch.Tensor], block: int,
                momentum: Optional[torch.Tensor] = None, momentum_out: Optional[torch.Tensor] = None,
                m: float = 0.0, nesterov: bool = False
                ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """One pass of a memory over ``grad`` (flattened):

    * without ``momentum`` (error feedback): ``v' = velocity + scale * grad``;
    * with it (DGC's momentum correction): ``u' = m * momentum + scale * grad`` and
      ``v' = velocity + u'`` (Nesterov: ``u' = m * (momentum + scale * grad)``,
      ``v' = velocity + u' + scale * grad``).

    ``*_out``: storage for the new memories (may be the old ones), else new tensors.
    Returns ``u'`` (None without momentum), ``v'``, the largest ``|v'|`` of every block of
    ``block`` entries, the short last one included (None for ``block`` 0), and whether
    ``grad`` is finite (a 0-d bool tensor on the device: no wait).
    """
    numel = grad.numel()
    velocity_out = torch.empty_like(velocity) if velocity_out is None else velocity_out
    if momentum is not None and momentum_out is None:
        momentum_out = torch.empty_like(momentum)
    mode = ERROR_FEEDBACK if momentum is None else (NESTEROV if nesterov else MOMENTUM)
    width = block if block else FLAT_BLOCK
    rows = max(1, ENTRIES_PER_PROGRAM // width)
    n_blocks = -(-numel // width)
    maxima = torch.empty(n_blocks if block else 1, dtype=velocity.dtype, device=grad.device)
    finite = torch.ones(1, dtype=torch.int32, device=grad.device)
    # Unused pointers get the velocity: any valid tensor will do where MODE leaves them alone.
    _memory_pass[(-(-n_blocks // rows),)](
        grad, velocity if momentum is None else momentum, velocity,
        velocity_out if momentum_out is None else momentum_out, velocity_out, maxima, finite,
        numel, float(scale), float(m), MODE=mode, BLOCK=width, ROWS=rows, MAXIMA=bool(block))
    return (momentum_out, velocity_out, maxima if block else None,
            finite.reshape(()).bool())
