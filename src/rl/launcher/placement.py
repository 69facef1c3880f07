"""Where a run's processes go: one pure function from the run and its hosts to what each host starts.

`plan(run, topology)` is the only place a multi-host layout is derived (roles, devices, inference URLs,
trainer node ranks, rendezvous). `rl --slurm` and `rl --k8s` write the run (`rl.toml`) and its topology
(`placement.toml`) once; every host starts `rl` from both, names its own index (`--placement.index i`),
computes the same list and takes its entry. A host started by hand (`--roles`, `--node-rank`, ...) states its
own entry with those flags instead (`given_host`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, model_validator

from rl.config import ConfigError, Section
from rl.inference.config import client_host
from rl.launcher.devices import DevicePlan, replicas_of, split_gpus

ALL_ROLES = ("inference", "orchestrator", "trainer")
ANY_ADDRESS = "0.0.0.0"  # servers other hosts reach
HOST_GPUS = "placement.inference_gpus, set by --slurm.gpus-per-node or --k8s.inference-gpus"


class PlacementConfig(Section):
    """The hosts of a run, in order: inference hosts, the orchestrator's own host (if any), trainer hosts."""

    hosts: Annotated[list[str], Field(description="each host's address as the others reach it, in order")] = []
    index: Annotated[int | None, Field(ge=0, description="this host: its position in hosts")] = None
    inference_hosts: Annotated[int, Field(ge=1, description="hosts running inference; the first also runs the "
                                                            "orchestrator unless orchestrator_host")] = 1
    trainer_hosts: Annotated[int, Field(ge=0, description="hosts running the trainer (one torchrun node each); 0: "
                                                          "the trainer shares the first inference host")] = 1
    orchestrator_host: Annotated[bool, Field(description="the orchestrator gets a host of its own")] = False
    inference_gpus: Annotated[int | None, Field(ge=1, description="GPUs per inference host (a server per "
                                                                  "inference.tensor_parallel_size of them); "
                                                                  "unset: CPU hosts")] = None
    trainer_gpus: Annotated[int | None, Field(ge=1, description="GPUs per trainer host; unset: CPU hosts")] = None
    rdzv_port: Annotated[
        int, Field(ge=1, le=65535, description="the trainer's rendezvous port on its first host")
    ] = 29400

    @property
    def size(self) -> int:
        return self.inference_hosts + self.orchestrator_host + self.trainer_hosts

    @model_validator(mode="after")
    def _check(self):
        if self.hosts and len(self.hosts) != self.size:
            raise ValueError(f"hosts lists {len(self.hosts)} addresses for {self.size} hosts ({self.inference_hosts} "
                             f"inference, {int(self.orchestrator_host)} orchestrator, {self.trainer_hosts} trainer)")
        if self.index is not None and self.index >= self.size:
            raise ValueError(f"index {self.index} is not one of the {self.size} hosts")
        return self


@dataclass(frozen=True)
class HostPlan:
    """What one host starts, and where it finds the others."""

    name: str  # in hosts/, configs/<name>/ and logs/<name>/ when the run spans hosts
    roles: tuple[str, ...]
    devices: DevicePlan
    trainer_nodes: int
    node_rank: int | None  # among the trainer's hosts; None where no trainer runs
    rdzv_endpoint: str | None  # torchrun's c10d rendezvous (trainer_nodes > 1)
    node_addr: str | None  # the address other trainer hosts reach this one at
    inference_urls: tuple[str, ...]  # the servers the orchestrator here uses; () where none runs
    inference_bind: str | None  # the address this host's servers bind (None: inference.host as configured)
    spans_hosts: bool  # other hosts take part in the run
    trainer_addr: str | None = None  # the trainer's first host (its rank 0) as the others reach it; None: not placed

    def runs(self, role: str) -> bool:
        return role in self.roles


def server_urls(address: str, port: int, replicas: int) -> list[str]:
    return [f"http://{address}:{port + r}" for r in range(replicas)]


def plan(run, topology: PlacementConfig) -> list[HostPlan]:
    """Every host of the run (`run`: an RLConfig as given; `topology.hosts`: the addresses)."""
    if not topology.hosts:
        raise ConfigError("placement.hosts is empty: a plan needs every host's address")
    hosts = topology.hosts
    n_inf = topology.inference_hosts
    orchestrator = n_inf if topology.orchestrator_host else 0
    trainers = list(range(n_inf + topology.orchestrator_host, topology.size)) or [0]
    roles = [_roles(i, n_inf, orchestrator, trainers) for i in range(topology.size)]
    per_node = _devices(run, topology, roles[trainers[0]], per_node=0).trainer_processes  # every trainer host's
    devices = [_devices(run, topology, r, per_node) for r in roles]
    urls = [url for i in range(n_inf) for url in server_urls(hosts[i], run.inference.port, devices[i].replicas)]
    rdzv = f"{hosts[trainers[0]]}:{topology.rdzv_port}" if len(trainers) > 1 else None
    return [
        HostPlan(
            name=hosts[i], roles=roles[i], devices=devices[i], trainer_nodes=len(trainers),
            node_rank=trainers.index(i) if i in trainers else None, rdzv_endpoint=rdzv if i in trainers else None,
            node_addr=hosts[i] if i in trainers and rdzv else None,
            inference_urls=tuple(urls) if i == orchestrator else (),
            inference_bind=ANY_ADDRESS if "inference" in roles[i] else None, spans_hosts=True,
            trainer_addr=hosts[trainers[0]],
        )
        for i in range(topology.size)
    ]


def _roles(i: int, inference_hosts: int, orchestrator: int, trainers: list[int]) -> tuple[str, ...]:
    here = {"inference": i < inference_hosts, "orchestrator": i == orchestrator, "trainer": i in trainers}
    return tuple(role for role in ALL_ROLES if here[role])


def _devices(run, topology: PlacementConfig, roles: tuple[str, ...], per_node: int) -> DevicePlan:
    """One host's devices. `per_node`: the trainer's processes per host (what a host without it records)."""
    inference, trainer = "inference" in roles, "trainer" in roles
    tp = run.inference.tensor_parallel_size
    if inference and trainer:
        if topology.inference_gpus is None:
            return DevicePlan(run.trainer_processes, [], [[] for _ in range(run.inference_replicas)])
        return split_gpus(topology.inference_gpus, run.trainer_gpus, run.inference_gpus, run.trainer_gpu_ids,
                          run.inference_gpu_ids, tp)
    if trainer:
        if topology.trainer_gpus is None:
            return DevicePlan(run.trainer_processes, [], [])
        return DevicePlan(topology.trainer_gpus, list(range(topology.trainer_gpus)), [])
    if inference:
        if topology.inference_gpus is None:
            return DevicePlan(per_node, [], [[] for _ in range(run.inference_replicas)])
        return DevicePlan(per_node, [], replicas_of(list(range(topology.inference_gpus)), tp, HOST_GPUS))
    return DevicePlan(per_node, [], [])


def given_base_urls(config) -> list[str]:
    """The servers the user named for this host's orchestrator (none: rl gives it its own or the planned ones)."""
    client = config.orchestrator.client
    return client.base_urls if "base_urls" in client.model_fields_set else []


def given_host(config, devices: DevicePlan) -> HostPlan:
    """This host as its own flags place it: by default one host running all three processes, the orchestrator
    using this host's servers unless orchestrator.client.base_urls names others."""
    i = config.inference
    local_urls = server_urls(client_host(i.host), i.port, devices.replicas)
    given_urls = given_base_urls(config)
    alone = sorted(config.roles) == sorted(ALL_ROLES) and config.trainer_nodes == 1 and not given_urls
    trainer = "trainer" in config.roles
    return HostPlan(
        name=config.host_name or socket.gethostname(), roles=tuple(config.roles), devices=devices,
        trainer_nodes=config.trainer_nodes, node_rank=config.node_rank if trainer else None,
        rdzv_endpoint=config.rdzv_endpoint if trainer else None, node_addr=config.node_addr if trainer else None,
        inference_urls=tuple(given_urls or local_urls) if "orchestrator" in config.roles else (),
        inference_bind=None, spans_hosts=not alone,
    )
