import pytest

from horovod_dgc.core import DGCConfig, DensitySchedule


def test_paper_warmup_densities_for_final_density_0_001_over_4_epochs():
    schedule = DGCConfig(density=0.001, warmup_epochs=4).schedule
    got = [schedule.density(e) for e in range(6)]
    assert got == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001], rel=1e-12)


def test_fractional_epochs_and_explicit_densities():
    schedule = DensitySchedule(0.01, warmup_epochs=2, densities=(0.5, 0.1))
    assert schedule.density(0.99) == 0.5
    assert schedule.density(1.5) == 0.1
    assert schedule.density(2.0) == 0.01


@pytest.mark.parametrize("kwargs", [dict(warmup_epochs=-1), dict(warmup_factor=0.0),
                                    dict(warmup_epochs=2, warmup_densities=(0.5,)),
                                    dict(warmup_epochs=1, warmup_densities=(1.5,))])
def test_bad_warmup_settings_raise_at_construction(kwargs):
    with pytest.raises(ValueError):
        DGCConfig(**kwargs)
