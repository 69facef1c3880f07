"""A host behind a slow link, on one machine: a network namespace joined to this one by a veth pair whose two ends
`tc` limits to a rate (a token bucket each way), as between two nodes. Needs root and `ip netns`."""

from __future__ import annotations

import os
import random
import subprocess


def why_no_link() -> str | None:
    """Why a limited link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    probe = f"rl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if subprocess.run(["tc", "-V"], capture_output=True).returncode != 0:
        return "no `tc` (iproute2)"
    return None


class SlowLink:
    """Namespace `ns` at `far` (its veth `far_dev`), this namespace at `near` (`near_dev`), `rate` each way (tc
    syntax: "1gbit"). Processes started under `prefix` run on the far side, gloo on its veth."""

    def __init__(self, rate: str):
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.ns, self.rate = f"rl-link-{tag}", rate
        self.near, self.far = f"{subnet}.1", f"{subnet}.2"
        self.near_dev, self.far_dev = f"rln{tag}", f"rlf{tag}"
        try:
            self._run("ip", "netns", "add", self.ns)
            self._run("ip", "link", "add", self.near_dev, "type", "veth", "peer", "name", self.far_dev)
            self._run("ip", "link", "set", self.far_dev, "netns", self.ns)
            self._run("ip", "addr", "add", f"{self.near}/24", "dev", self.near_dev)
            self._run("ip", "-n", self.ns, "addr", "add", f"{self.far}/24", "dev", self.far_dev)
            for netns, dev in ((None, self.near_dev), (self.ns, self.far_dev), (self.ns, "lo")):
                self._run("ip", *(["-n", netns] if netns else []), "link", "set", dev, "up")
            # A token bucket on each end's egress: `rate`, bursts up to 1 MB (more than one 64 KiB GSO packet, which
            # a smaller bucket would drop), at most 50 ms of queue.
            for netns, dev in ((None, self.near_dev), (self.ns, self.far_dev)):
                self._run("tc", *(["-n", netns] if netns else []), "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                          rate, "burst", "1mb", "latency", "50ms")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _run(*argv: str) -> None:
        done = subprocess.run(argv, capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.decode().strip()}")

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, "env", f"GLOO_SOCKET_IFNAME={self.far_dev}"]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.near_dev], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
