"""The stress harness of the hierarchical hang reads a run's outcome from its log."""
from benchmarks.hierarchical_stress import RUN_LISTS, TF_KIND_LISTS, classify, planned

RUN_LIST = RUN_LISTS[0]


def _ok(rank: int, kind: str, time: str = "08:19:57.038") -> str:
    return f"{time} [{rank}]<stdout>:rank {rank}/4 {kind} hierarchical ok"


def test_a_run_with_every_ok_and_no_timeout_passed():
    kinds = [run.replace("/", " ") for run in RUN_LIST.split(",")]
    log = "\n".join(_ok(r, k) for k in kinds for r in range(4))
    result = classify(log, RUN_LIST)
    assert (result.oks, result.expected_oks, result.timeouts) == (4 * len(kinds), 4 * len(kinds), [])
    assert result.passed
    assert result.last_ok.endswith(f"rank 3/4 {kinds[-1]} hierarchical ok")


def test_gloo_timeouts_are_read_per_rank_and_fail_the_run():
    # The lines of the 2026-11-27 reproduction (paths shortened).
    log = "\n".join([_ok(r, "blocksign stock") for r in range(4)] + [
        "07:57:16.690 [0]<stderr>:[2026-11-27 07:57:16.690275: E horovod/common/operations.cc:697] [0]: "
        "Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:133] "
        "Timed out waiting 30000ms for send operation to complete",
        "07:57:16.703 [2]<stderr>:[2026-11-27 07:57:16.703859: E horovod/common/operations.cc:697] [2]: "
        "Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 30000ms for recv operation to complete",
        "07:57:16.746 [1]<stderr>:  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer"])
    result = classify(log, RUN_LIST)
    assert result.timeouts == ["rank 0: send", "rank 2: recv"]
    assert result.oks == 4 and not result.passed


def test_the_longest_kind_runs_from_the_last_ok_of_the_kind_before_to_the_first_of_its_own():
    # topk: ranks done at 10-12 s; scalecom at 15-16 (3 s); blocksign at 59-61 (43 s); a
    # naive reference: the gaps between consecutive kinds, from the slowest to the fastest rank.
    times = {"topk stock": [10, 11, 12, 11], "scalecom own": [15, 16, 15, 15],
             "blocksign stock": [60, 61, 59, 59]}
    log = "\n".join(_ok(r, kind, f"08:19:{at:06.3f}") for kind, ats in times.items()
                     for r, at in enumerate(ats))
    expected = max(min(b) - max(a) for a, b in zip(list(times.values()), list(times.values())[1:]))
    assert expected == 43
    assert classify(log, RUN_LIST).longest_kind_s == expected
    assert classify("\n".join(_ok(r, "topk stock") for r in range(4)), RUN_LIST).longest_kind_s is None


def test_missing_oks_fail_a_run_without_timeouts():
    log = "\n".join(_ok(r, "topk stock") for r in range(4))
    assert not classify(log, RUN_LIST).passed


def test_the_frameworks_alternate_and_each_takes_its_run_lists_in_turn():
    plan = [planned(i, ["torch", "tensorflow"]) for i in range(6)]
    assert [framework for framework, _, _ in plan] == ["torch", "tensorflow"] * 3
    assert [run_list for _, _, run_list in plan[0::2]] == [RUN_LISTS[0], RUN_LISTS[1], RUN_LISTS[0]]
    assert [run_list for _, _, run_list in plan[1::2]] == [TF_KIND_LISTS[0], TF_KIND_LISTS[1], TF_KIND_LISTS[0]]
    assert [job.worker.name for _, job, _ in plan[:2]] == ["hierarchy_torch.py", "hierarchy_tensorflow.py"]
    assert [run_list for _, _, run_list in (planned(i, ["torch"]) for i in range(3))] == \
        [RUN_LISTS[0], RUN_LISTS[1], RUN_LISTS[0]]
