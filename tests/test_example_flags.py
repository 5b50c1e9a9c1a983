"""The examples' shared flags reach the library's options (examples/_flags.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _flags import compression_options  # noqa: E402
from pytorch_fashion_mnist import parse_args  # noqa: E402

from horovod_dgc.core.methods import BY_NAME  # noqa: E402


@pytest.mark.parametrize("flag, expected", [(["--small-density", "dense"], None),
                                            (["--small-density", "0.2"], 0.2)])
def test_small_density_flag_reaches_the_config(flag, expected):
    options = compression_options(parse_args(["--compression", "dgc", *flag]), 1)
    assert BY_NAME["dgc"].build(**options).config.small_density == expected


def test_without_the_flag_the_method_keeps_its_default():
    options = compression_options(parse_args(["--compression", "dgc"]), 1)
    assert "small_density" not in options
    assert BY_NAME["dgc"].build(**options).config.small_density == BY_NAME["dgc"].config().small_density


def test_beta_flag_reaches_scalecom_and_only_scalecom():
    options = compression_options(parse_args(["--compression", "scalecom", "--beta", "0.5"]), 1)
    assert BY_NAME["scalecom"].build(**options).config.beta == 0.5
    assert "beta" not in compression_options(parse_args(["--compression", "topk", "--beta", "0.5"]), 1)
    default = compression_options(parse_args(["--compression", "scalecom"]), 1)
    assert BY_NAME["scalecom"].build(**default).config.beta == BY_NAME["scalecom"].config().beta
