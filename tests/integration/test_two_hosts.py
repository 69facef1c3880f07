"""Two hosts on one machine: two network namespaces joined by a veth pair, the run directory on the filesystem
they share. Host `a` runs inference, the orchestrator and trainer node 0; host `b` runs trainer node 1; the
trainer spans both through torchrun's c10d rendezvous (gloo over the veth pair). Needs root (namespaces)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl.protocol import RunPaths, read_metrics, stable_steps
from tests.conftest import ROOT
from tests.integration.launched import SMALL_KV_CACHE, Launched, free_port

pytestmark = pytest.mark.integration
TOKEN = "two-hosts-admin-token"


def namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"rl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="needs root and `ip netns` (network namespaces)")


class TwoHosts:
    """Namespaces rl-<tag>-a and rl-<tag>-b; a at 10.<x>.<y>.1, b at .2, each with its own loopback."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.hosts = {
            "a": (f"rl-{tag}-a", f"{subnet}.1", f"rla{tag}"),
            "b": (f"rl-{tag}-b", f"{subnet}.2", f"rlb{tag}"),
        }
        (_, _, veth_a), (_, _, veth_b) = self.hosts["a"], self.hosts["b"]
        self.run(["ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b])
        for ns, address, veth in self.hosts.values():
            self.run(["ip", "netns", "add", ns])
            self.run(["ip", "link", "set", veth, "netns", ns])
            self.run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", veth])
            self.run(["ip", "-n", ns, "link", "set", veth, "up"])
            self.run(["ip", "-n", ns, "link", "set", "lo", "up"])

    @staticmethod
    def run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    def address(self, host: str) -> str:
        return self.hosts[host][1]

    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv run on `host`: in its namespace, gloo on its veth."""
        ns, _, veth = self.hosts[host]
        return ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={veth}", *argv]

    def close(self) -> None:
        for ns, _, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def two_hosts():
    hosts = TwoHosts()
    yield hosts
    hosts.close()


def host_command(model: Path, out: Path, hosts: TwoHosts, host: str, rdzv_port: int, max_steps: int) -> list[str]:
    configs = ROOT / "configs" / "reverse_text"
    roles = '["inference", "orchestrator", "trainer"]' if host == "a" else '["trainer"]'
    argv = [
        sys.executable, "-m", "rl.launcher.main",
        "--trainer", "@", str(configs / "train.toml"),
        "--orchestrator", "@", str(configs / "orch.toml"),
        "--inference", "@", str(configs / "infer.toml"),
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(max_steps), "--seq-len", "128",
        "--orchestrator.batch-size", "32", "--inference.port", str(free_port()), "--inference.admin-token", TOKEN,
        "--roles", roles, "--host-name", host, "--trainer-nodes", "2", "--node-rank", "0" if host == "a" else "1",
        "--rdzv-endpoint", f"{hosts.address('a')}:{rdzv_port}", "--node-addr", hosts.address(host),
        "--host-timeout-s", "10", *SMALL_KV_CACHE,
    ]
    return hosts.command(host, argv)


def start_both(model: Path, out: Path, hosts: TwoHosts, max_steps: int) -> tuple[Launched, Launched]:
    rdzv_port = free_port()
    return tuple(Launched(host_command(model, out, hosts, host, rdzv_port, max_steps)) for host in ("a", "b"))


@needs_namespaces
def test_a_trainer_across_two_hosts_trains_and_publishes(tiny_model, tmp_path, two_hosts):
    out = tmp_path / "run"
    a, b = start_both(tiny_model, out, two_hosts, 5)
    assert a.wait(timeout=900) == 0, a.output[-5000:] + "\n--- b ---\n" + b.output[-3000:]
    assert b.wait(timeout=60) == 0, b.output[-5000:]
    paths = RunPaths(out)
    metrics = read_metrics(paths)
    assert [m["step"] for m in metrics if m["process"] == "trainer"] == [0, 1, 2, 3, 4]
    orchestrator = [m for m in metrics if m["process"] == "orchestrator"]
    assert [m["step"] for m in orchestrator] == [0, 1, 2, 3, 4]
    assert orchestrator[-1]["policy_step"] >= 3  # inference moved to weights the two-node trainer published
    assert stable_steps(paths.weights_root)[-1] == 5
    trainer_log = (out / "logs" / "a" / "trainer.log").read_text()
    assert "rank 0/2" in trainer_log and "rank 1/2" in (out / "logs" / "b" / "trainer.log").read_text()
    assert {p.name for p in (out / "hosts").iterdir()} == {"a.json", "b.json"}


@needs_namespaces
def test_killing_one_host_ends_the_run_within_30s_naming_it(tiny_model, tmp_path, two_hosts):
    out = tmp_path / "run"
    a, b = start_both(tiny_model, out, two_hosts, 50)
    deadline = time.monotonic() + 600
    while len(stable_steps(RunPaths(out).weights_root)) < 2 and time.monotonic() < deadline:
        assert a.proc.poll() is None and b.proc.poll() is None, a.output[-3000:] + b.output[-3000:]
        time.sleep(0.5)
    on_b = [psutil.Process(b.proc.pid), *b.descendants()]
    for process in on_b:  # host b dies: every process of it at once, launcher included
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    killed_at = time.monotonic()
    code = a.wait(timeout=60)
    assert code != 0
    assert time.monotonic() - killed_at < 30, a.output[-3000:]
    assert "host 'b' (trainer, trainer node 1)" in a.output, a.output[-3000:]
    print(f"host a ended {time.monotonic() - killed_at:.1f}s after host b was killed:\n{a.output[-1500:]}")
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes still running: {leftover}"


@needs_namespaces
def test_weights_over_the_wire_cross_from_the_trainers_host_to_a_server_on_another(tiny_model, tmp_path, two_hosts):
    """Host `a` runs the trainer and the orchestrator, host `b` the server: every step goes over gloo from a's
    transfer store (bound to a's address only) to b, sealed with the secret both hosts were given, and b serves the
    trainer's checksum of each."""
    out, configs, port = tmp_path / "run", ROOT / "configs" / "reverse_text", free_port()
    common = [
        sys.executable, "-m", "rl.launcher.main",
        "--trainer", "@", str(configs / "train.toml"), "--orchestrator", "@", str(configs / "orch.toml"),
        "--inference", "@", str(configs / "infer.toml"),
        "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", "4", "--seq-len", "128",
        "--orchestrator.batch-size", "32", "--inference.admin-token", TOKEN, "--inference.port", str(port),
        "--transfer.backend", "gloo", "--transfer.host", two_hosts.address("a"), "--host-timeout-s", "10",
        *SMALL_KV_CACHE,
    ]
    secret = ["env", "RL_TRANSFER__SECRET=" + "5" * 64]  # as a job gives every host the same one
    a = Launched(two_hosts.command("a", secret + common + [
        "--roles", '["orchestrator", "trainer"]', "--host-name", "a", "--node-addr", two_hosts.address("a"),
        "--orchestrator.client.base-urls", f'["http://{two_hosts.address("b")}:{port}"]']))
    b = Launched(two_hosts.command("b", secret + common + [
        "--roles", '["inference"]', "--host-name", "b", "--node-addr", two_hosts.address("b"),
        "--inference.host", two_hosts.address("b")]))
    try:
        assert a.wait(timeout=900) == 0, a.output[-5000:] + "\n--- b ---\n" + b.output[-3000:]
    finally:
        b.stop()
    metrics = read_metrics(RunPaths(out))
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}
    assert all(trainer[step]["weights_sent"] for step in range(4)), trainer
    served = [c for m in metrics if m["process"] == "orchestrator" for c in m.get("served_checksums", [])]
    assert served and set(served) <= {m["weights_checksum"] for m in trainer.values()}, (served, trainer)
    assert "weights go over the wire (gloo): transfer store on " + two_hosts.address("a") in \
        (out / "logs" / "a" / "trainer.log").read_text()
