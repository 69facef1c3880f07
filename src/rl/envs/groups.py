"""A group's episodes as one request to an env server: one task, its n samplings, one reply with the n episodes whole.

verifiers' env server takes one episode per request (`run`): the task's data, client config and sampling validated,
the episode's traces diffed and streamed as deltas, then a reply, each message through the broker. rl's orchestrator
runs, retries and drops groups whole, so it sends a whole group as one `run_group` request, as prime-rl's
orchestrator sends its env servers groups: validated once, dispatched once (the group goes to one worker, whose
training client then sends its identical first requests as one request with n samples), answered once, each
episode's traces whole. Cancelling the request cancels the group's episodes on their worker.

Both ends are rl's: the orchestrator's client (`GroupClient`, verifiers' `EnvClient` with this request) and the
worker's handler (`serve_group`), which rl's env server routes to (rl/envs/worker_server.py). The broker
forwards the request like any other. verifiers' own `run` still works on rl's env server.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, ClassVar, Union

import msgpack
import verifiers.v1 as vf
import zmq
from pydantic import Field
from verifiers.v1.configs.agent import WireAgentConfig
from verifiers.v1.configs.client import EvalClientConfig, TrainClientConfig
from verifiers.v1.episode import WireEpisode
from verifiers.v1.serve import EnvClient
from verifiers.v1.serve.delta import HEADER_FIELDS, LIST_FIELDS, SCALAR_FIELDS, dump, pack, unpack
from verifiers.v1.serve.types import BaseRequest, HealthRequest, HealthResponse

from rl.envs.chat_replies import BoundedChatConfig
from rl.envs.engine_client import GroupedTrainClientConfig
from rl.patches import require_members

ROUTE = b"run_group"
RL_CLIENT_CONFIGS = (BoundedChatConfig, GroupedTrainClientConfig)  # rl's, which go whole (`serve_rl_client_configs`)
AGENT_CONFIGS_KEPT = 256  # distinct agent configs remembered (seeded samplings make one per rollout)
TRACE_FIELDS = {*HEADER_FIELDS, *LIST_FIELDS, *SCALAR_FIELDS}  # what verifiers' delta stream assembles of a trace
# verifiers' private members each end reads (verifiers 0.4.0; docs/architecture.md lists them): checked where a
# worker's server is made (rl/envs/worker_server.py) and where a client is made.
SERVER_MEMBERS = ("_running", "_build_task", "_context", "_gate", "frontend", "env")
CLIENT_MEMBERS = ("_pending", "_ensure_receiver", "_send_cancel", "_cancel_tasks", "_request", "socket")
logger = logging.getLogger(__name__)


class GroupRunRequest(BaseRequest):
    """`n = len(samplings)` episodes of one task: its dumped data, the client config every episode shares (rl's
    classes or verifiers', as verifiers' own `run` takes them: rl/patches `serve_rl_client_configs`), and each one's
    sampling (seeded rollouts differ by their seed)."""

    method: ClassVar[str] = ROUTE.decode()
    task_data: dict
    client: Union[(EvalClientConfig, TrainClientConfig, *RL_CLIENT_CONFIGS)]  # as verifiers' `run` takes it, patched
    model: str
    samplings: list[vf.SamplingConfig] = Field(min_length=1)


def episode_record(episode: vf.Episode) -> dict:
    """An episode dumped whole, as verifiers' client assembles a served one from its deltas: the episode without its
    traces, and each trace's header, lists and scalars."""
    return {**dump(episode, exclude={"traces"}),
            "traces": [dump(trace, include=TRACE_FIELDS) for trace in episode.traces]}


async def run_group_here(server, request: GroupRunRequest) -> list[dict]:
    """The group's episodes on this worker (`server`: verifiers' `EnvServer`), each bounded by the worker's
    `max_concurrent` gate; where one raises, the others are cancelled."""
    task = server._build_task(request.task_data)
    slots = server.env.slots(task, len(request.samplings))
    runs = [asyncio.ensure_future(server.env.run_slot(slot, server._context(request.client, request.model, sampling),
                                                      server._gate))
            for slot, sampling in zip(slots, request.samplings)]
    try:
        episodes = await asyncio.gather(*runs)
    finally:
        for run in runs:
            run.cancel()
    return [episode_record(episode) for episode in episodes]


async def serve_group(server, client_id: bytes, request_id: bytes, payload: bytes) -> None:
    """Answer one `run_group` request on verifiers' env server; registered as a run, so that verifiers' `cancel`
    finds it. A failure is answered as verifiers answers a failed run (success false, the error)."""
    server._running[request_id.decode()] = asyncio.current_task()
    try:
        request = GroupRunRequest.model_validate(msgpack.unpackb(payload, raw=False))
        reply: dict[str, Any] = {"success": True, "error": None, "episodes": await run_group_here(server, request)}
    except asyncio.CancelledError:  # answered all the same, so that the broker's count of what is out stays exact
        reply = {"success": False, "error": "Cancelled: group aborted"}
    except Exception as e:  # noqa: BLE001 - a failed group is data for the orchestrator, not the worker's end
        logger.warning("group failed: %s", e, exc_info=True)
        reply = {"success": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        server._running.pop(request_id.decode(), None)
    try:
        data = pack(reply)
    except Exception as e:  # noqa: BLE001 - answered, or the client waits for nothing
        data = pack({"success": False, "error": f"the group's reply could not be encoded: {type(e).__name__}: {e}"})
    try:
        await server.frontend.send_multipart([client_id, request_id, b"reply", data], copy=False)
    except zmq.ZMQError as e:  # the client is gone (ROUTER_MANDATORY): nothing waits for this reply
        logger.warning("could not send a group's reply: %s", e)


class ServerHealth(HealthResponse):
    """A health reply; rl's env server adds its live workers (rl/patches/verifiers.py: `answer_health_with`)."""

    workers: int | None = None


class GroupClient(EnvClient):
    """verifiers' `EnvClient`, which also runs groups (`run_group`) and reads rl's health reply (`health_reply`)."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        require_members(self, CLIENT_MEMBERS, "verifiers")
        self.agent_configs = AgentConfigs()

    async def health_reply(self, timeout_s: float) -> ServerHealth:
        """The server's health reply; TimeoutError where none came within `timeout_s`. Bounded as a whole: with no
        server to connect to, even the send waits (verifiers' own request)."""
        return await asyncio.wait_for(self._request(HealthRequest(), ServerHealth, timeout=timeout_s), timeout_s)

    async def run_group(self, request: GroupRunRequest) -> list[vf.Episode]:
        """The group's episodes, in the order of its samplings; RuntimeError with the server's error where it failed
        the group. Cancelled, it cancels the group on the server (as verifiers' `run` does an episode)."""
        self._ensure_receiver()
        request_id = uuid.uuid4().hex
        reply = asyncio.get_running_loop().create_future()
        self._pending[request_id] = reply
        payload = msgpack.packb(request.model_dump(mode="json"), use_bin_type=True)
        await self.socket.send_multipart([request_id.encode(), ROUTE, payload])
        try:
            data = await reply
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            cancel = asyncio.get_running_loop().create_task(self._send_cancel(request_id))
            self._cancel_tasks.add(cancel)  # held, or the loop may drop it before it sends
            cancel.add_done_callback(self._cancel_tasks.discard)
            raise
        answer = unpack(data)
        if not answer.get("success"):
            raise RuntimeError(answer.get("error") or "the env server failed the group")
        episodes = answer.get("episodes")
        if not isinstance(episodes, list) or len(episodes) != len(request.samplings):
            raise RuntimeError(f"the env server answered a group of {len(request.samplings)} with "
                               f"{len(episodes) if isinstance(episodes, list) else 'no'} episodes")
        # Validated here, not in a thread as verifiers' `run` does: a handoff per episode cost more of the
        # orchestrator's CPU than the validation (benchmarks/RESULTS.md).
        return [self.agent_configs.episode(record) for record in episodes]


class AgentConfigs:
    """Episodes validated with each trace's agent config validated once per distinct config: a group's traces carry
    the same one (the seat's harness, client and sampling), and pydantic_config's validators over its nested configs
    were half of the orchestrator's CPU per rollout (benchmarks/RESULTS.md). A config is shared by the episodes that
    carry it, as read-only as the rest of them."""

    def __init__(self) -> None:
        self.validated: dict[bytes, WireAgentConfig] = {}  # by their packed dump

    def episode(self, record: dict) -> vf.Episode:
        for trace in record.get("traces") or ():
            agent = trace.get("agent")
            if isinstance(agent, dict) and isinstance(agent.get("config"), dict):  # else the episode's check says
                agent["config"] = self.config(agent["config"])
        return WireEpisode.model_validate(record)

    def config(self, dumped: dict) -> WireAgentConfig:
        key = pack(dumped)
        config = self.validated.get(key)
        if config is None:
            if len(self.validated) >= AGENT_CONFIGS_KEPT:
                self.validated.clear()
            config = self.validated[key] = WireAgentConfig.model_validate(dumped)
        return config
