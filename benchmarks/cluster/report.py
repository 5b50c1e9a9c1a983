"""Tables, plots and claims from the cluster benchmark's records (``step.py --out``).

Ratios are to Horovod dense on the unshaped link (blank when that run is missing):
``step vs dense`` is a method's median step time over dense's, ``bytes vs dense`` the bytes a
worker sent per step over dense's; ``estimate vs sent`` is the library's network estimate
(``stats()``, or the all-reduce model for Horovod's own compression) over the interface bytes,
and ``+ idle x step vs sent`` the same with Horovod's negotiation added (the idle send rate
times the median step, which no estimate counts; ``make cluster-negotiation``).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

REFERENCE_LINK = "unshaped"
REFERENCE_METHOD = "dense"
MIN_DGC_REDUCTION = 300.0  # bytes on the interfaces, dense over dgc, 4 workers, ResNet-50
ESTIMATE_TOLERANCE = 0.15  # |estimate / interface bytes - 1| allowed
ESTIMATED_METHODS = ("dense", "dgc", "scalecom", "blocksign", "dgc-ddp")
# dgc with adaptive= may be this much slower than the faster of dense and fixed dgc.
ADAPTIVE_SLACK = 1.1
COLUMNS = ("link", "method", "optimizer", "setting", "workers", "model", "params", "batch_size",
           "image_size", "warmup_steps", "steps", "median_step_s", "images_per_s", "tx_bytes_per_step",
           "tx_bytes_per_step_max", "handed_bytes_per_step", "estimated_bytes_per_step",
           "idle_bytes_per_s", "step_vs_dense", "bytes_vs_dense", "estimate_vs_sent",
           "with_negotiation_vs_sent")


def load_records(path: Path) -> List[dict]:
    """Every JSON line of ``path``, with the two ratios added; ValueError if there is none."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no records")
    reference = find(rows, REFERENCE_LINK, REFERENCE_METHOD)
    for row in rows:
        row["step_vs_dense"] = (row["median_step_s"] / reference["median_step_s"]
                                if reference else None)
        row["bytes_vs_dense"] = (row["tx_bytes_per_step"] / reference["tx_bytes_per_step"]
                                 if reference else None)
        estimate, sent = row.get("estimated_bytes_per_step"), row["tx_bytes_per_step"]
        known = estimate is not None and sent
        row["estimate_vs_sent"] = estimate / sent if known else None
        negotiation = negotiation_bytes(row)
        row["with_negotiation_vs_sent"] = ((estimate + negotiation) / sent
                                           if known and negotiation is not None else None)
    return rows


def negotiation_bytes(row: dict) -> Optional[float]:
    """What Horovod's negotiation sends during a step: the idle send rate times the median
    step (None when the record has no idle rate)."""
    idle = row.get("idle_bytes_per_s")
    return None if idle is None else idle * row["median_step_s"]


def find(rows: List[dict], link: str, method: str) -> Optional[dict]:
    return next((r for r in rows if r["link"] == link and r["method"] == method), None)


def write_csv(rows: List[dict], path: Path) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _ratio(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.3g}"


def _mb(value: Optional[float]) -> str:
    return "" if value is None else f"{value / 1e6:.3f}"


def _kb(value: Optional[float]) -> str:
    return "" if value is None else f"{value / 1e3:.1f}"


def markdown_table(rows: List[dict]) -> str:
    lines = ["| link | method | optimizer | setting | median step (s) | images/s "
             "| MB sent per worker per step | estimated MB | handed to the collectives MB "
             "| idle kB/s | step vs dense | bytes vs dense | estimate vs sent "
             "| + idle x step vs sent |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['link']} | {r['method']} | {r['optimizer']} | {r['setting']} "
                     f"| {r['median_step_s']:.3f} | {r['images_per_s']:.1f} "
                     f"| {r['tx_bytes_per_step'] / 1e6:.3f} "
                     f"| {_mb(r.get('estimated_bytes_per_step'))} "
                     f"| {_mb(r.get('handed_bytes_per_step'))} "
                     f"| {_kb(r.get('idle_bytes_per_s'))} | {_ratio(r['step_vs_dense'])} "
                     f"| {_ratio(r['bytes_vs_dense'])} | {_ratio(r.get('estimate_vs_sent'))} "
                     f"| {_ratio(r.get('with_negotiation_vs_sent'))} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Claim:
    """A property the run should show, and whether it does (None: the run lacks the data)."""

    text: str
    value: Optional[float]
    passed: Optional[bool]
    why_not: str = "not measured in this run"  # where passed is None

    def line(self) -> str:
        if self.passed is None:
            return f"- n/a: {self.text} ({self.why_not})"
        return f"- {'PASS' if self.passed else 'FAIL'}: {self.text}: {self.value:.3g}"


def _claim(text: str, value: Optional[float], holds: Callable[[float], bool]) -> Claim:
    return Claim(text, value, None if value is None else holds(value))


def claims(rows: List[dict], min_speedup_100mbit: float = 3.0) -> List[Claim]:
    """The issue's targets, from whatever rows this run has."""
    def get(link: str, method: str, key: str) -> Optional[float]:
        row = find(rows, link, method)
        return None if row is None else row[key]

    dense_100, dgc_100 = get("100mbit", "dense", "median_step_s"), get("100mbit", "dgc", "median_step_s")
    dgc_1g, dense_ref = get("1gbit", "dgc", "median_step_s"), get(REFERENCE_LINK, "dense", "median_step_s")
    dense_bytes, dgc_bytes = (get(REFERENCE_LINK, "dense", "tx_bytes_per_step"),
                              get(REFERENCE_LINK, "dgc", "tx_bytes_per_step"))
    return [
        _claim(f"100 Mbit/s: dgc's step is at least {min_speedup_100mbit:g}x faster than dense's "
               f"(speed-up)", dense_100 / dgc_100 if dense_100 and dgc_100 else None,
               lambda v: v >= min_speedup_100mbit),
        _claim("1 Gbit/s: dgc's step is within 1.3x of dense's on the unshaped link (ratio)",
               dgc_1g / dense_ref if dgc_1g and dense_ref else None, lambda v: v <= 1.3),
        _claim(f"dgc sends at least {MIN_DGC_REDUCTION:g}x fewer bytes per step than dense "
               f"(reduction)", dense_bytes / dgc_bytes if dense_bytes and dgc_bytes else None,
               lambda v: v >= MIN_DGC_REDUCTION),
    ] + adaptive_claims(get) + [estimate_claim(find(rows, REFERENCE_LINK, method), method)
                                for method in ESTIMATED_METHODS]


def estimate_claim(row: Optional[dict], method: str) -> Claim:
    """``stats()``' network bytes against the interface's, where a launch ran ``method``
    alone: interleaved with others, the interface also carries Horovod's negotiation of
    their collectives' names in every cycle."""
    text = (f"{method}: stats()'s network estimate within {ESTIMATE_TOLERANCE:.0%} of the "
            f"interface bytes (estimate / sent)")
    if row is not None and row.get("interleaved"):
        return Claim(text, None, None, "interleaved with other methods: their names are negotiated "
                                       "in every cycle too")
    return _claim(text, None if row is None else row["estimate_vs_sent"], lambda v: abs(v - 1.0) <= ESTIMATE_TOLERANCE)


def adaptive_claims(get: Callable[[str, str, str], Optional[float]]) -> List[Claim]:
    """dgc with ``adaptive=`` against dense and fixed dgc, link by link (median steps)."""
    def step(link: str, method: str) -> Optional[float]:
        return get(link, method, "median_step_s")

    def ratio(link: str, *others: str) -> Optional[float]:
        mine, theirs = step(link, "dgc-adaptive"), [step(link, m) for m in others]
        return mine / min(theirs) if mine and all(theirs) else None

    return [
        _claim(f"unshaped: dgc adaptive's step within {ADAPTIVE_SLACK:g}x of dense's (ratio)",
               ratio("unshaped", "dense"), lambda v: v <= ADAPTIVE_SLACK),
        _claim(f"1 Gbit/s: dgc adaptive's step within {ADAPTIVE_SLACK:g}x of the faster of dense and dgc (ratio)",
               ratio("1gbit", "dense", "dgc"), lambda v: v <= ADAPTIVE_SLACK),
        _claim(f"100 Mbit/s: dgc adaptive's step within {ADAPTIVE_SLACK:g}x of dgc's (ratio)",
               ratio("100mbit", "dgc"), lambda v: v <= ADAPTIVE_SLACK),
    ]


def plot(rows: List[dict], out_dir: Path) -> List[Path]:
    """``step_time.png`` (per method, one bar per link) and ``bytes_per_step.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    workers = rows[0]["workers"]
    paths = [out_dir / "step_time.png", out_dir / "bytes_per_step.png"]

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(methods) * max(1, len(links)) / 2), 4.5))
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        values = [(find(rows, link, m) or {}).get("median_step_s", 0.0) for m in methods]
        bars = ax.bar([x + i * width for x in range(len(methods))], values, width, label=link)
        ax.bar_label(bars, labels=[f"{v:.2g}" for v in values], fontsize=7)
    ax.set_xticks([x + width * (len(links) - 1) / 2 for x in range(len(methods))], methods)
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"Training step, {workers} workers, per link")
    ax.legend(title="link")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    link = REFERENCE_LINK if REFERENCE_LINK in links else links[0]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(methods)), 4.5))
    values = [(find(rows, link, m) or {}).get("tx_bytes_per_step", 0.0) / 1e6 for m in methods]
    bars = ax.bar(methods, values)
    ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MB sent per worker per step (log)")
    ax.set_title(f"Bytes on the wire ({link} link, interface counters, {workers} workers)")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def write_report(rows: List[dict], out_dir: Path, header: str,
                 min_speedup_100mbit: float = 3.0) -> Dict[str, object]:
    """CSV, Markdown (header, table, claims) and plots in ``out_dir``; returns the claims, the
    Markdown text and the plots' paths."""
    write_csv(rows, out_dir / "results.csv")
    found = claims(rows, min_speedup_100mbit)
    text = "\n\n".join([header, markdown_table(rows), "\n".join(c.line() for c in found)]) + "\n"
    (out_dir / "results.md").write_text(text)
    return {"claims": found, "markdown": text, "plots": plot(rows, out_dir)}
