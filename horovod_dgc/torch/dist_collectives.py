"""``torch.distributed`` collectives by kind (the kinds of core/collectives.py): the
transport of the DDP communication hook (:mod:`horovod_dgc.torch.ddp`), the twin of
``collectives.py``, which launches them with Horovod. No Horovod here.

Every collective is launched asynchronously (``async_op=True``) and awaited in
:meth:`DistTransport.wait`. ``torch.distributed`` matches collectives by the order in which
ranks launch them, not by name: callers launch in the same order on every rank (DDP calls
its hooks in bucket order; a two-stage family launches its second stages in label order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, alltoall_chunks


def _all_gather_single():
    """``dist.all_gather_single``, or, on a torch that predates it, its old name
    ``all_gather_into_tensor`` (torch 2.13 brought the new name and deprecated the old)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Pending:
    """A launched collective: its work, the tensor it fills, and what to say if it fails.

    Attributes:
        work: the ``torch.distributed`` work object.
        result: the tensor the collective writes into.
        kind, name: the collective's kind and name (for errors).
        average_over: divide the result by this on arrival (an all-reduce: the number of
            workers; Gloo has no averaging reduction), or 1.
    """

    work: Any
    result: torch.Tensor
    kind: str
    name: str
    average_over: int = 1


@dataclass(frozen=True)
class DistTransport:
    """The collectives of :data:`~horovod_dgc.core.collectives.KINDS` over a
    ``torch.distributed`` process group (a
    :class:`~horovod_dgc.core.collectives.Transport`).

    Attributes:
        group: the process group (``None``: the default one); ranks given to and returned
            by this transport are ranks within it.
    """

    group: Optional[Any] = None

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def launch(self, kind: str, message: torch.Tensor, name: str, root: int = 0,
               chunks: Optional[Sequence[int]] = None) -> Pending:
        """Start collective ``kind`` on ``message`` (flat); ``root``: a broadcast's sender,
        a rank within :attr:`group`; ``chunks``: an alltoall's elements for each destination,
        the same on every rank, where they are not equal. Every rank must hand an allgather,
        an all-reduce, a broadcast or an alltoall a message of the same size."""
        message = message.contiguous()
        try:
            if kind == ALLGATHER:
                result = message.new_empty(message.numel() * self.size())
                work = _all_gather_single()(result, message, group=self.group, async_op=True)
                return Pending(work, result, kind, name)
            if kind == ALLREDUCE:
                result = message.clone()
                work = dist.all_reduce(result, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                return Pending(work, result, kind, name, average_over=self.size())
            if kind == BROADCAST:
                result = message.clone()
                src = root if self.group is None else dist.get_global_rank(self.group, root)
                work = dist.broadcast(result, src=src, group=self.group, async_op=True)
                return Pending(work, result, kind, name)
            if kind == ALLTOALL:
                sizes = alltoall_chunks(message.numel(), self.size(), chunks)
                mine = sizes[self.rank()]
                result = message.new_empty(mine * self.size())
                work = dist.all_to_all_single(result, message, output_split_sizes=[mine] * self.size(),
                                              input_split_sizes=sizes, group=self.group, async_op=True)
                return Pending(work, result, kind, name)
        except RuntimeError as error:
            raise RuntimeError(f"rank {self.rank()}: the {kind} of {name!r} ({message.numel()} "
                               f"elements of {message.dtype}) could not start: {error}") from error
        raise ValueError(f"unknown collective {kind!r} (for {name!r})")

    def wait(self, handle: Pending) -> torch.Tensor:
        """What the collective delivered (an all-reduce: the average)."""
        try:
            handle.work.wait()
        except RuntimeError as error:
            raise RuntimeError(f"rank {self.rank()}: the {handle.kind} of {handle.name!r} failed "
                               f"(a rank with another message size, or a rank gone?): "
                               f"{error}") from error
        if handle.average_over != 1:
            handle.result.div_(handle.average_over)
        return handle.result
