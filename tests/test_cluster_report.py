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
    (4.0, 2.5, 0.49e6, 0.14, [True] * 3 + [None] * 3 + [True] * 5),
    (5.0, 2.7, 0.51e6, 0.16, [False] * 3 + [None] * 3 + [False] * 5),
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


@pytest.mark.parametrize("unshaped_s, one_gbit_s, hundred_s, expected", [
    (2.1, 1.05, 4.2, [True] * 3), (2.3, 1.2, 4.5, [False] * 3)])
def test_adaptive_claims_compare_with_dense_the_faster_mode_and_fixed_dgc(tmp_path, unshaped_s, one_gbit_s,
                                                                          hundred_s, expected):
    """Unshaped: against dense; 1 Gbit/s: against the faster of dense and dgc (dgc here);
    100 Mbit/s: against fixed dgc; each at most 1.1x."""
    write_records(tmp_path / "r.jsonl", [
        record("unshaped", "dense", 2.0, 150e6), record("unshaped", "dgc", 3.0, 1e6),
        record("unshaped", "dgc-adaptive", unshaped_s, 1e6),
        record("1gbit", "dense", 2.0, 150e6), record("1gbit", "dgc", 1.0, 1e6),
        record("1gbit", "dgc-adaptive", one_gbit_s, 1e6),
        record("100mbit", "dense", 13.0, 150e6), record("100mbit", "dgc", 4.0, 1e6),
        record("100mbit", "dgc-adaptive", hundred_s, 1e6)])
    found = [c for c in claims(load_records(tmp_path / "r.jsonl")) if "adaptive" in c.text]
    assert [c.passed for c in found] == expected


def test_interleaved_runs_do_not_judge_the_bytes_estimate(tmp_path):
    """An interleaved launch's interface also carries Horovod's negotiation of the other
    methods' names: the estimate claim says so instead of failing or passing."""
    write_records(tmp_path / "r.jsonl", [dict(record("unshaped", m, 2.0, 1e6, 0.5e6), interleaved=True)
                                         for m in ("dense", "dgc")])
    found = {c.text.split(":")[0]: c for c in claims(load_records(tmp_path / "r.jsonl"))}
    assert found["dgc"].passed is None and "interleaved with other methods" in found["dgc"].line()


def test_claims_without_their_links_are_not_measured(tmp_path):
    write_records(tmp_path / "r.jsonl", [record("unshaped", "dense", 2.0, 150e6)])
    found = claims(load_records(tmp_path / "r.jsonl"))
    assert [c.passed for c in found] == [None] * 11
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


# -- make cluster-faults: what it parses and how it tells a complete checkpoint ------------------
from benchmarks.cluster.fault_train import MODEL_FILE, atomic_save, last_complete, step_dir  # noqa: E402
from benchmarks.cluster.faults import Fault, first_error_line, parse_fault  # noqa: E402


@pytest.mark.parametrize("text,fault", [("none", Fault("none")), ("stall:1@4", Fault("stall", 1, 4)),
                                        ("split:12@30", Fault("split", 12, 30)), ("slow:3", Fault("slow", 3))])
def test_faults_parse(text, fault):
    assert parse_fault(text) == fault
    assert fault.name == text


@pytest.mark.parametrize("text", ["stall:1", "stall@4", "split:a@4", "slow:3@2", "kill:1@2", "none:1", ""])
def test_malformed_faults_are_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match="expected none, stall:RANK@STEP, split:HOST@STEP or slow:HOST"):
        parse_fault(text)


def test_a_checkpoint_counts_once_its_model_file_is_written(tmp_path):
    for step in (3, 6, 9):
        step_dir(tmp_path, step).mkdir()
        atomic_save({"step": step}, step_dir(tmp_path, step) / "rank0-of-2.pt")
    for step in (3, 6):
        atomic_save({"step": step}, step_dir(tmp_path, step) / MODEL_FILE)
    # Step 9's parts were written, its model not: a fault struck during the save.
    assert last_complete(tmp_path) == 6
    assert sorted(p.name for p in step_dir(tmp_path, 6).iterdir()) == [MODEL_FILE, "rank0-of-2.pt"]
    assert last_complete(tmp_path / "nothing-yet") is None


def test_the_error_shown_is_the_first_python_error_of_the_failed_rank():
    tail = ("worker rank2 exited with status 1 after 40 s; stopped the other workers.\n"
            "Last lines of rank2.log:\n[2]<stderr>:Traceback (most recent call last):\n"
            "[2]<stderr>:horovod.common.exceptions.HorovodInternalError: rank 2 of 4: the allgather "
            "'horovod_dgc.bucket.fc.bias' did not complete\n[2]<stderr>:RuntimeError: later")
    assert first_error_line(tail) == ("horovod.common.exceptions.HorovodInternalError: rank 2 of 4: "
                                      "the allgather 'horovod_dgc.bucket.fc.bias' did not complete")
    assert first_error_line("no error here") is None
