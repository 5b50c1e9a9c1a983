"""Elastic Horovod (Gloo) with a compressor: a worker dies mid-interval, the others roll back
to the last commit and go on; parameters identical, gradient mass conserved
(tests/workers/elastic_torch.py checks both on every rank), on Horovod's optimizer and on our
fused one, whose step the reset interrupts with gradients submitted and exchanges in flight."""
import re
import socket
import subprocess
import sys

import pytest

from conftest import WORKERS, run_horovodrun

# Three names of this machine: horovodrun treats them as three hosts (each resolves to a
# local address, so workers start without ssh), and blacklists the one whose worker fails.
HOSTS = ("localhost", "127.0.0.1", socket.gethostname())
VICTIM = "127.0.0.1"


def elastic_job(tmp_path, discovery: str, np: int, *options: str, gloo_timeout_s: int = 10,
                launcher: tuple = ()) -> subprocess.CompletedProcess:
    """tests/workers/elastic_torch.py under horovodrun, elastic between 2 and 3 workers;
    ``discovery``: the lines of the host discovery script after its shebang; ``launcher``:
    more horovodrun flags."""
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\n" + discovery)
    script.chmod(0o755)
    return run_horovodrun(["-np", str(np), "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                           str(script), "--gloo", "--gloo-timeout-seconds", str(gloo_timeout_s), *launcher,
                           sys.executable, str(WORKERS / "elastic_torch.py"), *options], timeout_s=300)


def lose_a_worker(tmp_path, *options: str, event: str = "kill", launcher: tuple = ()) -> subprocess.CompletedProcess:
    """Three workers; the one on VICTIM dies at step 12, two steps after a commit."""
    return elastic_job(tmp_path, "".join(f"echo {h}:1\n" for h in HOSTS), 3, "--event", event,
                       "--victim", VICTIM, "--marker", str(tmp_path / "victim_died"), *options,
                       launcher=launcher)


# The stock path's elastic state is in make test with a worker added (below); its roll-back, in the slow set.
@pytest.mark.parametrize("method,path", [pytest.param("topk", "stock", marks=pytest.mark.slow), ("topk", "fused"),
                                         ("scalecom", "fused")])
def test_worker_lost_mid_interval_rolls_back_and_conserves_gradient_mass(tmp_path, method, path):
    proc = lose_a_worker(tmp_path, "--method", method, "--path", path)
    marker, out = tmp_path / "victim_died", proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert marker.read_text() == "killed at step 12"
    assert out.count("of 3 entry at step 0: identical and conserved ok") == 3, out[-6000:]
    # The commit before the failure was at step 10: the survivors resume there, two of them.
    assert out.count("of 2 entry at step 10: identical and conserved ok") == 2, out[-6000:]
    assert out.count("of 2 final at step 24: identical and conserved ok") == 2, out[-6000:]


def test_a_killed_host_is_dropped_and_added_again_when_it_comes_back(tmp_path):
    """Horovod blacklists the host whose worker died; once its cooldown (1-2 s) is over the
    discovery script still lists it, and the driver starts a new worker there, which joins
    the two survivors at the commit of step 20 and takes its share of their memories."""
    proc = lose_a_worker(tmp_path, "--method", "topk", "--path", "fused", event="return",
                         launcher=("--blacklist-cooldown-range", "1", "2"))
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert (tmp_path / "victim_died").read_text() == "killed at step 12"
    assert out.count("of 2 entry at step 10: identical and conserved ok") == 2, out[-6000:]
    assert out.count("of 3 entry at step 20: identical and conserved ok") == 3, out[-6000:]
    assert out.count("of 3 final at step 24: identical and conserved ok") == 3, out[-6000:]


@pytest.mark.parametrize("path", ["stock", "fused"])
def test_worker_added_at_a_commit_takes_its_share_and_conserves_gradient_mass(tmp_path, path):
    marker = tmp_path / "host_added"
    # The third host is listed once rank 0 asks for it by writing the marker.
    discovery = f"echo {HOSTS[0]}:1\necho {HOSTS[1]}:1\n[ -e {marker} ] && echo {HOSTS[2]}:1\nexit 0\n"
    # The survivors wait in Gloo's rendezvous while the newcomer imports torch and Horovod:
    # on a loaded 2-core machine that took over 10 s once ("Wait timeout").
    proc = elastic_job(tmp_path, discovery, 2, "--event", "grow", "--marker", str(marker), "--path", path,
                       gloo_timeout_s=60)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert marker.read_text() == "host added at step 10"
    assert out.count("of 2 entry at step 0: identical and conserved ok") == 2, out[-6000:]
    # The newcomer syncs to the commit at step 10 and takes its share of the memories.
    assert out.count("of 3 entry at step 10: identical and conserved ok") == 3, out[-6000:]
    assert out.count("of 3 final at step 24: identical and conserved ok") == 3, out[-6000:]


def test_a_reset_that_bypasses_our_state_is_refused_naming_the_old_and_new_world(tmp_path):
    """Horovod's own TorchState resizes the world under the compressor: the survivors stop at
    their next exchange with an error that says so, not with malformed-message errors. One
    survivor starts its step 5 s after the other, which has stopped and shut Horovod down by
    then: the late one must refuse too, before it hands Horovod anything (a Horovod call there
    fails as a recoverable reset, and the driver waits for hosts instead of ending the job)."""
    proc = lose_a_worker(tmp_path, "--state", "horovods", "--lag-after-reset-s", "5",
                         launcher=("--elastic-timeout", "60"))
    assert proc.returncode != 0
    # Which ranks refuse depends on the order horovodrun gives the hosts ranks.
    refusals = re.findall(r"joined as rank \d of 3 workers, but this is now rank \d of 2", proc.stdout)
    assert len(refusals) == 2, proc.stdout[-6000:]
    assert "horovod_dgc.torch.elastic.TorchState" in proc.stdout, proc.stdout[-6000:]
