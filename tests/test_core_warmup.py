"""Warm-up sparsity against the papers' formula written out here, and the warning given when
the schedule is never advanced."""
import math
import warnings

import pytest
import torch

from horovod_dgc.core import DGCConfig, DensitySchedule
from horovod_dgc.core.warmup import WARMUP_STALL_STEPS, WarmupWatch
from horovod_dgc.torch.engine import Engine
from horovod_dgc.core.methods import BY_NAME


@pytest.mark.parametrize("rho,epochs", [(0.001, 4), (0.01, 4), (0.001, 2), (0.05, 1)])
def test_densities_fall_by_rho_to_the_one_over_w_plus_one_per_epoch(rho, epochs):
    schedule = DGCConfig(density=rho, warmup_epochs=epochs).schedule
    c = math.exp(math.log(rho) / (epochs + 1))  # c ** (W + 1) == rho
    expected = [c ** (e + 1) for e in range(epochs)] + [rho, rho]
    got = [schedule.density(e) for e in range(epochs + 2)]
    assert got == pytest.approx(expected, rel=1e-12)
    ratios = [got[e + 1] / got[e] for e in range(epochs)]
    assert ratios == pytest.approx([c] * epochs, rel=1e-12), "one factor per epoch, down to rho"


def test_the_papers_setting_gives_the_papers_ramp():
    """DGC's 75%, 93.75%, 98.4375%, 99.6% sparsity before 99.9%, to 2%."""
    schedule = DGCConfig(density=0.001, warmup_epochs=4).schedule
    paper = [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    assert [schedule.density(e) for e in range(5)] == pytest.approx(paper, rel=0.02)


def test_a_factor_or_explicit_densities_replace_the_formula_and_fractions_count_as_started():
    assert DGCConfig(density=0.001, warmup_epochs=2, warmup_factor=0.25).schedule.density(1) == 0.0625
    schedule = DensitySchedule(0.01, warmup_epochs=2, densities=(0.5, 0.1))
    assert schedule.density(0.99) == 0.5
    assert schedule.density(1.5) == 0.1
    assert schedule.density(2.0) == 0.01


def test_steps_per_epoch_drives_the_schedule_by_the_step_count():
    config = DGCConfig(density=0.001, warmup_epochs=2, steps_per_epoch=10)
    assert config.density_for(9, epoch=0.0) == config.schedule.density(0)
    assert config.density_for(10, epoch=0.0) == config.schedule.density(1)
    assert config.density_for(25, epoch=0.0) == 0.001


@pytest.mark.parametrize("kwargs", [dict(warmup_epochs=-1), dict(warmup_factor=0.0),
                                    dict(warmup_epochs=2, warmup_densities=(0.5,)),
                                    dict(warmup_epochs=1, warmup_densities=(1.5,)),
                                    dict(steps_per_epoch=0)])
def test_bad_warmup_settings_raise_at_construction(kwargs):
    with pytest.raises(ValueError):
        DGCConfig(**kwargs)


def test_a_schedule_never_advanced_warns_once():
    watch = WarmupWatch(DGCConfig(warmup_epochs=3).schedule)
    assert "set_epoch() was not called" in watch.warning(0)
    assert watch.warning(WARMUP_STALL_STEPS) is None, "once only"
    watch = WarmupWatch(DGCConfig(warmup_epochs=3).schedule)
    watch.epoch_set(0)
    assert watch.warning(0) is None
    assert "still 0 after" in watch.warning(WARMUP_STALL_STEPS)
    watch = WarmupWatch(DGCConfig(warmup_epochs=3).schedule)
    watch.epoch_set(0)
    watch.epoch_set(1)
    assert watch.warning(WARMUP_STALL_STEPS) is None
    assert WarmupWatch(DGCConfig(warmup_epochs=3, steps_per_epoch=5).schedule).warning(0) is None
    assert WarmupWatch(DGCConfig().schedule).warning(0) is None


def test_the_engine_warns_when_training_starts_without_set_epoch(device):
    engine = Engine(BY_NAME["dgc"].build(warmup_epochs=2), world_size=1, rank=0)
    with pytest.warns(UserWarning, match="set_epoch"):
        engine.compress("w", torch.randn(64, 64, device="cpu").to(device), None)
    engine = Engine(BY_NAME["dgc"].build(warmup_epochs=2), world_size=1, rank=0)
    engine.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.compress("w", torch.randn(64, 64, device="cpu").to(device), None)


def test_explicit_warmup_densities_never_go_below_the_final_density():
    """``density = max(warmup_densities[e], rho)`` (docs/algorithms.md#warm-up): an entry
    below rho is raised to it. Catches the list taken as it is."""
    schedule = DensitySchedule(0.01, warmup_epochs=3, densities=(0.5, 0.001, 0.02))
    assert [schedule.density(e) for e in range(4)] == [0.5, 0.01, 0.02, 0.01]
    assert min(schedule.densities_in_use) == 0.01


def test_small_tensors_send_the_larger_of_the_small_density_and_the_warmups():
    """A small tensor's density is the small density, or the warm-up's when larger (the
    docstring of ``small_density``); a large tensor's is the warm-up's. Catches the smaller
    of the two taken."""
    config = DGCConfig(density=0.001, small_density=0.05, warmup_epochs=4)
    ramp = 0.001 ** (1 / 5)  # epoch 0 of the warm-up: about 25%
    assert config.density_for(0, 0.0, small=True) == pytest.approx(ramp)
    assert config.density_for(0, 0.0) == pytest.approx(ramp)
    assert config.density_for(0, 4.0, small=True) == 0.05
    assert config.density_for(0, 4.0) == 0.001
