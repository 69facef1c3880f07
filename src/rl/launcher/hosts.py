"""The hosts of one run, seen through the shared run directory.

Each `rl` launcher (one per host) owns `<output_dir>/hosts/<name>.json` and rewrites it every `BEAT_S`:
the processes it runs, its state (running, finished, failed), why it failed, and the time. Every
launcher reads the others' files on each poll, so a run spread over hosts ends together: a host that
failed, or whose file stopped changing for `timeout_s` (the host died, or lost the shared filesystem), stops
the others, which name it. No network between launchers is needed, only the filesystem they already share.
Silence is measured on the reader's monotonic clock from when it saw a peer's beat change, never by comparing
the peer's clock with its own: hosts' clocks may disagree by more than `timeout_s`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

from rl.protocol import RunPaths, atomic_write_text

BEAT_S = 2.0
FINISHING = ("trainer", "orchestrator")  # roles whose end is the run's end; inference serves until then


@dataclass(frozen=True)
class Host:
    name: str
    roles: tuple[str, ...]
    state: str  # running | finished | failed
    reason: str
    time: float  # of the last beat, or of the failure, on the writer's clock
    trainer_node: int | None  # node rank, on hosts running the trainer

    def describe(self) -> str:
        node = f", trainer node {self.trainer_node}" if self.trainer_node is not None else ""
        return f"host {self.name!r} ({'+'.join(self.roles)}{node})"


class HostBoard:
    """This host's file, and what the others' say."""

    def __init__(self, paths: RunPaths, name: str, roles: tuple[str, ...], trainer_node: int | None,
                 trainer_nodes: int, timeout_s: float):
        self.directory = paths.hosts
        self.me = Host(name, roles, "running", "", time.time(), trainer_node)
        self.trainer_nodes, self.timeout_s = trainer_nodes, timeout_s
        self.last_beat = 0.0
        self.seen: dict[str, tuple[float, float]] = {}  # peer -> (its last beat's time, when we saw it: monotonic)

    def join(self) -> None:
        """Forget the files of hosts that are no longer beating (an earlier launch of this run), then beat. Only
        here are clocks compared: a live host's file removed by a skewed clock is back at its next beat."""
        now = time.time()
        for host in self.hosts():
            if host.name != self.me.name and now - host.time > self.timeout_s:
                (self.directory / f"{host.name}.json").unlink(missing_ok=True)
        self.beat(force=True)

    def beat(self, state: str | None = None, reason: str | None = None, force: bool = False) -> None:
        """Rewrite this host's file, at most every BEAT_S unless `force`; state and reason stay as they were
        unless given."""
        now = time.time()
        if not force and now - self.last_beat < BEAT_S:
            return
        self.me = replace(self.me, state=state or self.me.state, reason=self.me.reason if reason is None else reason,
                          time=now)
        atomic_write_text(self.directory / f"{self.me.name}.json", json.dumps(asdict(self.me)) + "\n")
        self.last_beat = now

    def hosts(self) -> list[Host]:
        hosts = []
        for path in sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []:
            try:
                record = json.loads(path.read_text())
                hosts.append(Host(**record | {"roles": tuple(record["roles"])}))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not ours: read again on the next poll
        return hosts

    def peers(self) -> list[Host]:
        return [h for h in self.hosts() if h.name != self.me.name]

    def silent_for(self, host: Host) -> float:
        """Seconds since this host saw `host`'s beat change (0 when it changed now, or it is not running)."""
        now = time.monotonic()
        beat, seen = self.seen.get(host.name, (None, now))
        if beat != host.time:
            self.seen[host.name] = (host.time, now)
            return 0.0
        return now - seen if host.state == "running" else 0.0

    def down(self, host: Host) -> bool:
        """Failed, or silent for longer than `timeout_s`."""
        return host.state == "failed" or self.silent_for(host) > self.timeout_s

    def trouble(self) -> Host | None:
        """The peer that failed, or went silent, first; None while every peer is well."""
        down = [h for h in self.peers() if self.down(h)]
        return min(down, key=lambda h: h.time, default=None)

    def run_finished(self) -> bool:
        """Every trainer node and the orchestrator have finished (this host's own state included)."""
        hosts = self.peers() + [self.me]
        trainers = {h.trainer_node for h in hosts if "trainer" in h.roles and h.state == "finished"}
        orchestrator = any("orchestrator" in h.roles and h.state == "finished" for h in hosts)
        return len(trainers) == self.trainer_nodes and orchestrator

    def settle(self) -> Host | None:
        """After this host failed: wait (at most `timeout_s` past the last beat of any peer still running) for
        every peer to fail, finish or fall silent, and return the host that went down first, this one
        included: a peer killed outright beats last before this host's processes notice it."""
        deadline = time.monotonic() + self.timeout_s + BEAT_S
        while time.monotonic() < deadline:
            if not any(h.state == "running" and not self.down(h) for h in self.peers()):
                break
            time.sleep(0.5)
        down = [h for h in self.peers() if self.down(h)] + [self.me]
        return min(down, key=lambda h: h.time)
