"""A host whose own name does not resolve (a container runtime that writes no /etc/hosts entry for it, as a buildah
chroot does): a single-host run needs no name, so it runs as anywhere else. The run goes in a UTS namespace of
its own (root's `unshare --uts`) under a hostname that resolves nowhere; torchrun would hand the trainer's ranks
that name for their rendezvous, and they would wait out its timeout."""

import shutil
import socket
import subprocess

import pytest

from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration
HOSTNAME = "rl-test-host-that-resolves-nowhere"


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--uts", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs root's unshare --uts (a hostname of the run's own)")
def test_a_single_host_run_finishes_where_the_hosts_name_does_not_resolve(tiny_model, tmp_path):
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(HOSTNAME, None)
    out = tmp_path / "run"
    renamed = ["unshare", "--uts", "sh", "-c", f'hostname {HOSTNAME} && exec "$@"', "sh"]
    run = Launched([*renamed, *rl_command(tiny_model, out, 2)])
    assert run.wait(timeout=240) == 0, "".join(run.lines[-60:])
    assert [m["step"] for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"] == [0, 1]
