"""benchmarks/cluster/report.py: ratios to dense on the unshaped link, the table, the claims."""
import json

import pytest

from benchmarks.cluster.report import claims, load_records, markdown_table, write_report


def record(link: str, method: str, step_s: float, sent_bytes: float,
           estimated_bytes: float = None) -> dict:
    return {"handed_bytes_per_step": estimated_bytes, "estimated_bytes_per_step": estimated_bytes,
            "link": link, "method": method, "optimizer": "opt", "setting": "s", "workers": 4,
            "model": "resnet50", "params": 25557032, "batch_size": 32, "image_size": 32,
            "warmup_steps": 2, "steps": 5, "median_step_s": step_s, "images_per_s": 128 / step_s,
            "tx_bytes_per_step": sent_bytes, "tx_bytes_per_step_max": sent_bytes,
            "step_s": [step_s] * 5}


def write_records(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_ratios_are_to_dense_on_the_unshaped_link(tmp_path):
    write_records(tmp_path / "r.jsonl", [record("unshaped", "dense", 2.0, 150e6),
                                         record("unshaped", "dgc", 2.2, 1e6),
                                         record("100mbit", "dense", 14.0, 152e6)])
    rows = load_records(tmp_path / "r.jsonl")
    assert [r["step_vs_dense"] for r in rows] == pytest.approx([1.0, 1.1, 7.0])
    assert [r["bytes_vs_dense"] for r in rows] == pytest.approx([1.0, 1 / 150, 152 / 150])
    assert "| 100mbit | dense | opt | s | 14.000 | 9.1 | 152.000 |  |  |  | 7 | 1.01 |  |" in markdown_table(rows)


def test_without_dense_unshaped_the_ratios_are_blank(tmp_path):
    write_records(tmp_path / "r.jsonl", [record("100mbit", "dgc", 2.0, 1e6)])
    rows = load_records(tmp_path / "r.jsonl")
    assert rows[0]["step_vs_dense"] is None
    assert markdown_table(rows).endswith("| 1.000 |  |  |  |  |  |  |  |")


def test_negotiation_is_the_idle_rate_times_the_step(tmp_path):
    dgc = dict(record("unshaped", "dgc", 2.0, 400e3, 300e3), idle_bytes_per_s=25e3)
    write_records(tmp_path / "r.jsonl", [dgc, record("unshaped", "dense", 2.0, 150e6, 150e6)])
    rows = load_records(tmp_path / "r.jsonl")
    assert rows[0]["estimate_vs_sent"] == pytest.approx(0.75)
    assert rows[0]["with_negotiation_vs_sent"] == pytest.approx((300e3 + 25e3 * 2.0) / 400e3)
    assert rows[1]["with_negotiation_vs_sent"] is None  # no idle rate recorded
    assert "| 0.75 | 0.875 |" in markdown_table(rows)


def test_no_records_is_an_error(tmp_path):
    (tmp_path / "r.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        load_records(tmp_path / "r.jsonl")


@pytest.mark.parametrize("dgc_100_s, dgc_1g_s, dgc_bytes, estimate_error, expected", [
    (4.0, 2.5, 0.49e6, 0.14, [True] * 8),
    (5.0, 2.7, 0.51e6, 0.16, [False] * 8),
])
def test_claims_hold_or_fail_at_their_thresholds(tmp_path, dgc_100_s, dgc_1g_s, dgc_bytes,
                                                 estimate_error, expected):
    def unshaped(method, sent, error):
        return record("unshaped", method, 2.0, sent, sent * (1 + error))

    write_records(tmp_path / "r.jsonl", [
        unshaped("dense", 150e6, estimate_error), unshaped("dgc", dgc_bytes, -estimate_error),
        unshaped("scalecom", 2e6, estimate_error), unshaped("blocksign", 5e6, -estimate_error),
        unshaped("dgc-ddp", dgc_bytes, estimate_error),
        record("1gbit", "dgc", dgc_1g_s, dgc_bytes), record("100mbit", "dense", 13.0, 152e6),
        record("100mbit", "dgc", dgc_100_s, dgc_bytes)])
    assert [c.passed for c in claims(load_records(tmp_path / "r.jsonl"))] == expected


def test_claims_without_their_links_are_not_measured(tmp_path):
    write_records(tmp_path / "r.jsonl", [record("unshaped", "dense", 2.0, 150e6)])
    found = claims(load_records(tmp_path / "r.jsonl"))
    assert [c.passed for c in found] == [None] * 8
    assert found[0].line().startswith("- n/a: ")


def test_report_files(tmp_path):
    write_records(tmp_path / "r.jsonl", [record("unshaped", "dense", 2.0, 150e6),
                                         record("unshaped", "dgc", 2.1, 1e6)])
    report = write_report(load_records(tmp_path / "r.jsonl"), tmp_path, "# header", 1.0)
    assert (tmp_path / "results.md").read_text() == report["markdown"]
    assert report["markdown"].startswith("# header\n\n| link |")
    assert "FAIL: dgc sends at least 300x fewer bytes per step than dense (reduction): 150" in report["markdown"]
    assert (tmp_path / "results.csv").read_text().splitlines()[0].startswith("link,method,optimizer")
    assert all(p.stat().st_size > 1000 for p in report["plots"])
