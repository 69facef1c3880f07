"""Weights over the wire in a launched run: where the servers reach the trainer's transfer store, and the secret
that seals every step (rl/weights/)."""

from __future__ import annotations

import secrets
from typing import Any

from rl.config import ConfigError
from rl.inference.config import InferenceConfig
from rl.launcher.placement import HostPlan
from rl.orchestrator.config import OrchestratorConfig
from rl.trainer.config import TrainerConfig


def place_transfer_store(sections: dict[str, Any], host: HostPlan) -> None:
    """Where the servers reach the trainer's transfer store (rank 0 offers it): a placed run's first trainer host
    unless transfer.host is set; a run across hosts started by hand must name it, as 127.0.0.1 is this host."""
    if any("host" in section.transfer.model_fields_set for section in sections.values()):
        return
    if host.trainer_addr is not None:
        for section in sections.values():
            section.transfer.host = host.trainer_addr
    elif host.spans_hosts:
        raise ConfigError("weights over the wire across hosts need --transfer.host: the address the servers reach "
                          "the trainer's first host at (its rank 0 holds the transfer store); 127.0.0.1 is each host "
                          "itself")


def give_transfer_secret(t: TrainerConfig, i: InferenceConfig, o: OrchestratorConfig, host: HostPlan) -> None:
    """The secret that seals every step over the wire (rl/weights/digest.py): one per run, made here unless set, in
    the trainer's and the servers' configs only (the orchestrator runs environments' code and needs none of it).
    Every host of a run across hosts must hold the same one, so there it must be given."""
    if not (host.runs("trainer") or host.runs("inference")):  # an orchestrator's host: it neither sends nor loads
        t.transfer.secret = i.transfer.secret = o.transfer.secret = None
        return
    if t.transfer.secret is None and host.spans_hosts:
        raise ConfigError("weights over the wire across hosts need the same transfer.secret on every host: export "
                          "RL_TRANSFER__SECRET=$(openssl rand -hex 32) on each (--slurm and --k8s make one per job)")
    secret = t.transfer.secret or secrets.token_hex(32)
    t.transfer.secret = i.transfer.secret = secret
    o.transfer.secret = None
