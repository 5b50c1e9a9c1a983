"""``make traffic-model``: the bytes each worker sends on the network per training step, by
method and aggregation, as the number of workers grows (ResNet-50's 161 parameter tensors,
25,557,032 parameters; no training and no network involved).

    python -m benchmarks.traffic_model [--max-workers 256] [--plot docs/img/traffic_model.png]

The model is the library's own: each method's message layouts (``Method.exchanges``, or
``Method.bucket_exchanges`` for a bucket of tensors compressed as one: the same sizes its
compressors hand to Horovod) and the bytes a ring collective sends per worker
(``collectives.network_bytes``); a tensor a method does not compress is all-reduced in
float32. It is what ``stats()`` reports, computed without running a step. It leaves out
Horovod's own negotiation (a few kB per cycle, whatever is sent) and TCP/IP headers: see
docs/benchmarks.md for how far the interfaces differ.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from horovod_dgc.core.bucket import Bucket, Plan
from horovod_dgc.core.collectives import ALLREDUCE, DEFAULT_BUCKET_CAP_MB, cut_buckets, network_bytes
from horovod_dgc.core.method import Method
from horovod_dgc.core.methods import BY_NAME

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from _resnet import resnet50  # noqa: E402

# (label, method name or None for dense, options): each method at its defaults.
ROWS: Tuple[Tuple[str, Optional[str], dict], ...] = (
    ("dense", None, {}),
    ("dgc", "dgc", {}),
    ("dgc sparse all-reduce", "dgc", {"aggregation": "sparse_allreduce"}),
    ("topk", "topk", {}),
    ("topk sparse all-reduce", "topk", {"aggregation": "sparse_allreduce"}),
    ("gaussiank", "gaussiank", {}),
    ("gaussiank sparse all-reduce", "gaussiank", {"aggregation": "sparse_allreduce"}),
    ("scalecom", "scalecom", {}),
    ("blocksign", "blocksign", {}),
)


def resnet50_shapes() -> List[Tuple[int, ...]]:
    return [tuple(p.shape) for p in resnet50().parameters()]


def per_worker_bytes(method: Optional[Method], shapes: Sequence[Tuple[int, ...]], workers: int) -> float:
    """Bytes one worker sends per step for every tensor of ``shapes`` (float32 gradients): a
    method that is ``bucketed`` compresses its tensors in buckets of 25 MB, cut in reverse
    order as both Horovod paths cut them."""
    total = 0.0
    compressed = []
    for shape in shapes:
        numel = math.prod(shape)
        if method is None or not method.config.compresses(shape, "float32"):
            total += network_bytes(ALLREDUCE, 4 * numel, workers)
        elif method.bucketed:
            compressed.append(shape)
        else:
            density = method.config.density_for(0, 0.0, method.config.is_small(shape))
            total += method.network_bytes(numel, "float32", density, workers)
    if compressed:
        total += sum(network_bytes(kind, nbytes, workers) for plan in _plans(method, compressed[::-1])
                     for kind, nbytes in method.bucket_exchanges(plan, workers))
    return total


def _plans(method: Method, shapes: Sequence[Tuple[int, ...]]) -> List[Plan]:
    """The plans of ``shapes``' buckets (in that order) at the config's densities."""
    config = method.config
    cut = cut_buckets([4 * math.prod(s) for s in shapes], DEFAULT_BUCKET_CAP_MB * 2 ** 20)
    plans = []
    for b, members in enumerate(cut):
        bucket = Bucket.of(f"b{b}", [(f"t{b}.{i}", math.prod(shapes[i]), config.is_small(shapes[i]))
                                     for i in members], "float32")
        plans.append(Plan.at(bucket, [config.density_for(0, 0.0, s.small) for s in bucket.segments]))
    return plans


def table(shapes: Sequence[Tuple[int, ...]], workers: Sequence[int]) -> Dict[str, List[float]]:
    """Label -> bytes per worker per step at each number of workers."""
    out = {}
    for label, name, options in ROWS:
        out[label] = [per_worker_bytes(None if name is None else BY_NAME[name].build(**options),
                                       shapes, n) for n in workers]
    return out


def markdown(rows: Dict[str, List[float]], workers: Sequence[int]) -> str:
    lines = ["| method | " + " | ".join(f"N={n}" for n in workers) + " |",
             "|---|" + "---:|" * len(workers)]
    dense = rows["dense"]
    for label, values in rows.items():
        cells = [f"{v / 1e6:.3f}" if label == "dense" else f"{v / 1e6:.3f} ({d / v:.0f}x)"
                 for v, d in zip(values, dense)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Dict[str, List[float]], workers: Sequence[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, values in rows.items():
        style = "--" if "sparse all-reduce" in label else "-"
        ax.plot(workers, [v / 1e6 for v in values], style, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("MB sent per worker per step (model)")
    ax.set_title("ResNet-50 (25.6M parameters), each method at its defaults")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-workers", type=int, default=256, help="largest N (powers of 2 from 2)")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "traffic_model.png")
    args = p.parse_args(argv)
    workers = [2 ** e for e in range(1, int(math.log2(args.max_workers)) + 1)]
    rows = table(resnet50_shapes(), workers)
    print("MB each worker sends per step (the model; x: fewer than dense)\n")
    print(markdown(rows, workers))
    plot(rows, workers, args.plot)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
