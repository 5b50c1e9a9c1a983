"""The DDP hook's transport (``horovod_dgc.torch.dist_collectives.DistTransport``) under
``torchrun``, without Horovod: every collective kind on every device this machine has, each
rank's result checked against what the ranks' messages make by definition (the concatenation,
the average, the root's message, the exchanged chunks, equal or uneven). ``--horovod`` (under
``horovodrun``) checks Horovod's transport (``horovod_dgc.torch.collectives.HOROVOD``) the same
way on CPU tensors.

Backends: Gloo for CPU tensors; for CUDA tensors NCCL where every rank has a GPU of its own,
else Gloo (which copies them through the host). ``--without-all-gather-single`` removes
``torch.distributed.all_gather_single`` first, as torch before 2.13 lacks it.
"""
import argparse
import warnings
from typing import List

import torch
import torch.distributed as dist

from horovod_dgc.core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, Transport
from horovod_dgc.torch.dist_collectives import DistTransport

ELEMENTS_PER_RANK = 6  # an all-to-all sends each rank ELEMENTS_PER_RANK / size of them


def message_of(rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rank ``rank``'s message: distinct values on every rank, exact in every dtype."""
    return (torch.arange(ELEMENTS_PER_RANK) + 100 * rank).to(dtype).to(device)


def expected(kind: str, rank: int, size: int, dtype: torch.dtype, root: int) -> torch.Tensor:
    messages: List[torch.Tensor] = [message_of(r, dtype, "cpu") for r in range(size)]
    if kind == ALLGATHER:
        return torch.cat(messages)
    if kind == ALLREDUCE:
        return sum(m.double() for m in messages).div(size).to(dtype)
    if kind == BROADCAST:
        return messages[root]
    chunk = ELEMENTS_PER_RANK // size  # ALLTOALL: chunk r of every rank goes to rank r
    return torch.cat([m[rank * chunk:(rank + 1) * chunk] for m in messages])


def uneven_chunks(size: int) -> List[int]:
    """An alltoall's chunks for each destination, the same on every rank: 2, 0, 1, 3, 2, 0,
    ... elements (an empty one when there are three ranks or more)."""
    return [(2, 0, 1, 3)[j % 4] for j in range(size)]


def check_uneven_alltoall(transport: Transport, device: str, label: str) -> None:
    rank, size = transport.rank(), transport.size()
    chunks = uneven_chunks(size)
    starts = [sum(chunks[:j]) for j in range(size)]
    messages = [torch.arange(sum(chunks), dtype=torch.int32) + 100 * r for r in range(size)]
    got = transport.wait(transport.launch(ALLTOALL, messages[rank].to(device), "alltoall.uneven", chunks=chunks))
    want = torch.cat([m[starts[rank]:starts[rank] + chunks[rank]] for m in messages])
    assert torch.equal(got.cpu(), want), f"rank {rank} {label} uneven alltoall: {got.tolist()} != {want.tolist()}"


def check(transport: Transport, device: str, label: str) -> None:
    rank, size = transport.rank(), transport.size()
    for kind, dtype in ((ALLGATHER, torch.int32), (ALLGATHER, torch.uint8), (ALLREDUCE, torch.float32),
                        (BROADCAST, torch.int32), (ALLTOALL, torch.int32)):
        if kind == ALLTOALL and ELEMENTS_PER_RANK % size:
            continue
        root = size - 1
        message = message_of(rank, dtype, device)
        got = transport.wait(transport.launch(kind, message, f"{kind}.{dtype}", root=root))
        assert got.device.type == device, f"{label} {kind}: the result is on {got.device}"
        want = expected(kind, rank, size, dtype, root)
        assert torch.equal(got.cpu(), want), \
            f"rank {rank} {label} {kind} {dtype}: {got.tolist()} != {want.tolist()}"
    check_uneven_alltoall(transport, device, label)
    print(f"rank {rank} {label} transport ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--without-all-gather-single", action="store_true")
    parser.add_argument("--horovod", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.horovod:
        import horovod.torch as hvd
        from horovod_dgc.torch.collectives import HOROVOD
        hvd.init()
        check(HOROVOD, "cpu", "horovod cpu")
        return
    if args.without_all_gather_single:
        del dist.all_gather_single  # the old name, which torch 2.13 deprecated, is then expected
    else:
        # The transport calls no deprecated name where torch has the new one.
        warnings.simplefilter("error", FutureWarning)
    print(f"torch {torch.__version__}: all_gather_single "
          f"{'present' if hasattr(dist, 'all_gather_single') else 'absent'}", flush=True)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    check(DistTransport(), "cpu", "gloo cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        check(DistTransport(), "cuda", "gloo cuda")
        if torch.cuda.device_count() >= size:
            nccl = dist.new_group(backend="nccl")
            check(DistTransport(nccl), "cuda", "nccl cuda")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
