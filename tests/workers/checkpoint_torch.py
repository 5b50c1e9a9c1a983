"""Compressor state on real Horovod ranks: save / load round trips, refusals, and resuming
with another number of workers.

``--mode roundtrip``: for every method and both paths, train 3 steps, save, load into a
fresh model and compressor; the states match exactly, and one more step on the original and on
the restored copy gives identical parameters and memories. Then the refusals.
``--mode save DIR``: 3 steps of every method, each rank saves its part to DIR.
``--mode resume DIR``: every rank loads all saved parts with ``redistribute``; the memories
averaged over the new ranks equal those averaged over the old ones, blocksign's server
residual is the same vector, and training goes on.
"""
import argparse
import io
from pathlib import Path
from typing import Dict, List

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.torch.checkpoint import redistribute
from horovod_dgc.torch.optimizer import COMPRESSOR_STATE_KEY

METHODS = {"dgc": dict(density=0.01, warmup_epochs=2, momentum=0.9),
           "topk": dict(density=0.01, warmup_epochs=2),
           "gaussiank": dict(density=0.01),
           "scalecom": dict(density=0.01),
           "blocksign": dict(momentum=0.5, block_size=64)}


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 300):
        super().__init__()
        self.first = torch.nn.Linear(64, hidden)   # weight compressed, bias dense
        self.second = torch.nn.Linear(hidden, 50)  # weight compressed


def build(method: str, path: str, hidden: int = 300, **overrides):
    torch.manual_seed(0)
    model = Net(hidden)
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(),
                                                    **{**METHODS[method], **overrides})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(sgd, named_parameters=model.named_parameters(), compression=compression)
    compression = optimizer._compression if path == "own" else compression
    return model, compression, optimizer


def train(model, compression, optimizer, steps: int, first_step: int = 0) -> None:
    compression.set_epoch(1)
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        optimizer.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in model.parameters())
        loss.backward()
        optimizer.step()


def serialized(state: dict) -> dict:
    """``state`` after torch.save and torch.load (weights only): checkpoints must survive it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert {k: v for k, v in a.items() if k != "states"} == \
           {k: v for k, v in b.items() if k != "states"}, what
    assert a["states"].keys() == b["states"].keys(), what
    for name, tensors in a["states"].items():
        assert tensors.keys() == b["states"][name].keys(), f"{what} {name}"
        for key, value in tensors.items():
            assert torch.equal(value, b["states"][name][key]), f"{what}: {name}.{key} differs"


def expect_refusal(load, words: List[str], what: str) -> None:
    try:
        load()
    except ValueError as error:
        missing = [w for w in words if w not in str(error)]
        assert not missing, f"{what}: error {error!r} does not name {missing}"
        return
    raise AssertionError(f"{what}: loading was not refused")


def roundtrip(method: str, path: str) -> None:
    model, compression, optimizer = build(method, path)
    train(model, compression, optimizer, 3)
    saved = serialized(optimizer.state_dict() if path == "own" else compression.state_dict())
    part = saved[COMPRESSOR_STATE_KEY] if path == "own" else saved
    assert part["steps"] and part["states"], "nothing was saved"

    copy, copy_compression, copy_optimizer = build(method, path)
    copy.load_state_dict(model.state_dict())
    if path == "own":
        copy_optimizer.load_state_dict(saved)
    else:
        copy_compression.load_state_dict(saved)
    assert_same_state(compression.state_dict(), copy_compression.state_dict(), f"{method} {path}")
    assert copy_compression.density == compression.density

    train(model, compression, optimizer, 1, first_step=3)
    train(copy, copy_compression, copy_optimizer, 1, first_step=3)
    for (name, p), q in zip(model.named_parameters(), copy.parameters()):
        assert torch.equal(p, q), f"{method} {path}: {name} differs after the restored step"
    assert_same_state(compression.state_dict(), copy_compression.state_dict(),
                      f"{method} {path} after one more step")
    refusals(method, path, part)
    print(f"rank {hvd.rank()} {method} {path} roundtrip ok", flush=True)


def refusals(method: str, path: str, part: dict) -> None:
    other = "topk" if method != "topk" else "dgc"
    _, fresh, _ = build(other, path)
    expect_refusal(lambda: fresh.load_state_dict(part), ["method", part["method"]], "another method")
    if "density" in METHODS[method]:
        _, fresh, _ = build(method, path, density=0.02)
        expect_refusal(lambda: fresh.load_state_dict(part), ["config", "density"], "another density")
    _, fresh, fresh_optimizer = build(method, path, hidden=200)
    load = ((lambda: fresh_optimizer.load_state_dict({**fresh_optimizer.state_dict(),
                                                       COMPRESSOR_STATE_KEY: part}))
            if path == "own" else (lambda: fresh.load_state_dict(part)))
    expect_refusal(load, ["elements"], "another shape")
    _, fresh, _ = build(method, path)
    renamed = {**part, "states": {f"renamed.{n}": s for n, s in part["states"].items()}}
    expect_refusal(lambda: fresh.load_state_dict(renamed), ["does not have", "renamed."],
                   "another tensor set")
    elsewhere = {**part, "rank": (part["rank"] + 1) % hvd.size()}
    if hvd.size() > 1:
        expect_refusal(lambda: fresh.load_state_dict(elsewhere), ["rank", "redistribute"],
                       "another rank's part")


def part_file(folder: Path, method: str, rank: int) -> Path:
    return folder / f"{method}-rank{rank}.pt"


def save(folder: Path) -> None:
    for method in METHODS:
        model, compression, optimizer = build(method, "stock")
        train(model, compression, optimizer, 3)
        torch.save(compression.state_dict(), part_file(folder, method, hvd.rank()))
    print(f"rank {hvd.rank()} saved", flush=True)


def averaged_memories(states: Dict[str, Dict[str, torch.Tensor]], world: int) -> Dict[str, torch.Tensor]:
    """Per-worker memories averaged over this world's ranks (server shards gathered)."""
    out = {}
    for name in sorted(states):
        for key in sorted(states[name]):
            value, label = states[name][key], f"check.{key}.{name}"
            if key == "server":
                out[f"{name}.{key}"] = hvd.allgather(value, name=label)
            else:
                out[f"{name}.{key}"] = hvd.allreduce(value.double(), op=hvd.Sum, name=label) / world
    return out


def resume(folder: Path) -> None:
    for method in METHODS:
        old = sorted(folder.glob(f"{method}-rank*.pt"))
        parts = [torch.load(part_file(folder, method, r)) for r in range(len(old))]
        assert len(parts) != hvd.size(), "the resume must change the number of workers"
        model, compression, optimizer = build(method, "stock")
        compression.load_state_dict(redistribute(parts, hvd.size(), hvd.rank()))
        now = averaged_memories(compression.state_dict()["states"], hvd.size())
        for label, value in now.items():
            name, key = label.rsplit(".", 1)
            saved = [p["states"][name][key] for p in parts]
            if key == "server":
                expected = torch.cat(saved)
                numel = parts[0]["states"][name]["residual"].numel()
                assert torch.equal(value[:numel], expected[:numel]), f"{method} {label}"
                assert not value[numel:].any() and not expected[numel:].any(), f"{method} {label}"
            else:
                expected = sum(s.double() for s in saved) / len(saved)
                torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7,
                                           msg=f"{method} {label}: mass not conserved")
        assert compression.state_dict()["steps"] == parts[0]["steps"]
        train(model, compression, optimizer, 2, first_step=3)
        print(f"rank {hvd.rank()} {method} resumed on {hvd.size()} from {len(parts)} ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["roundtrip", "save", "resume"], required=True)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if args.mode == "roundtrip":
        for name in args.methods.split(","):
            for path in ("stock", "own"):
                roundtrip(name, path)
    elif args.mode == "save":
        save(args.dir)
    else:
        resume(args.dir)
