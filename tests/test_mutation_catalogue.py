"""benchmarks/mutation.py (``make mutation-check``): its catalogue still applies to the code,
and its harness tells a caught mutant from one that no test catches."""
from pathlib import Path

import pytest

from benchmarks.mutation import KERNELS, LAYERS, MUTANTS, TESTS, Mutant, copy_tree, stale_reason, try_mutant
from conftest import ROOT


def test_every_mutant_still_applies_once_and_every_layer_has_its_tests():
    """Catches code that moved under the catalogue (a mutant that would silently test nothing)."""
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "two mutants share an id"
    stale = {m.id: stale_reason(m) for m in MUTANTS if stale_reason(m)}
    assert not stale, stale
    assert {m.layer for m in MUTANTS} == set(LAYERS)
    for layer, files in TESTS.items():
        assert all((ROOT / "tests" / f).is_file() for f in files), layer
    for mutant in (m for m in MUTANTS if m.test):
        file, test = mutant.test.split("::")
        assert f"def {test}(" in (ROOT / "tests" / file).read_text(), mutant.id


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("mutants")
    copy_tree(tree)
    return tree


def test_the_harness_names_the_test_that_catches_a_mutant_and_restores_the_copy(tree):
    """A mutant of the warm-up formula fails the warm-up test in the copy; the copy is as
    before afterwards. Catches a harness that runs the original tree, reports every mutant
    as caught, or leaves one edit in place for the next."""
    mutant = next(m for m in MUTANTS if m.id == "warmup-epoch-offset")
    before = (tree / mutant.path).read_text()
    verdict = try_mutant(mutant, tree, ["test_core_warmup.py"])
    assert verdict.caught_by and verdict.caught_by.startswith("tests/test_core_warmup.py::"), verdict
    assert (tree / mutant.path).read_text() == before
    assert (ROOT / mutant.path).read_text() == before  # the working tree is never edited


def test_the_harness_reports_a_mutant_that_no_test_catches(tree):
    """An edit of a docstring changes no behaviour: it must survive."""
    harmless = Mutant("docstring", "horovod_dgc/core/warmup.py", '"""Warm-up sparsity',
                      '"""Warm-up  sparsity', "a docstring")
    verdict = try_mutant(harmless, tree, ["test_core_warmup.py"])
    assert verdict.caught_by is None and not verdict.stale, verdict


def test_a_kernel_mutant_is_compiled_into_the_copy_and_its_kernels_put_back(tree):
    """A C kernel's mutant is caught only if the copy is built again with it; afterwards the
    copy holds the original kernel. Catches a harness that tests the kernels compiled before
    the edit (every C mutant would survive) or leaves the mutant's build for the next one."""
    mutant = next(m for m in MUTANTS if m.id == "kernel-count-at-threshold-missed")
    built = next((tree / KERNELS).glob("_selection*.so"))
    before = built.read_bytes()
    verdict = try_mutant(mutant, tree, [
        "test_kernels_torch.py::test_collect_and_count_take_the_entries_equal_to_the_threshold"])
    assert verdict.caught_by and "equal_to_the_threshold" in verdict.caught_by, verdict
    assert built.read_bytes() == before
    assert mutant.layer == "core" and mutant.tests[0] == "test_kernels_torch.py"
