"""rl's env server (`env-server`, rl/envs/server.py): an environment served by verifiers' env-server pool, its
episodes run in worker processes that call the real inference server themselves, sent and received through
verifiers' own `EnvClient`."""

import asyncio
import re
import subprocess
import sys
import time

import psutil

import pytest
import verifiers.v1 as vf
from verifiers.v1.episode import WireEpisode
from verifiers.v1.serve import EnvClient
from verifiers.v1.serve.delta import DeltaStreamer, EpisodeAssembly, TraceSummary, dump, pack, unpack

from rl.config import API_KEY_VAR
from rl.envs.config import EnvConfig
from rl.envs.loading import load_environment
from rl.envs.groups import AgentConfigs, GroupClient, episode_record
from rl.envs.client import ServedEpisodes
from rl.envs.rollouts import InferenceClient, Sampling, model_contexts, run_group, to_result
from rl.envs.process_setup import apply_patches
from rl.protocol import RunPaths, read_metrics
from rl.renderer import renderer_config
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT
from tests.integration.inference_server import Server, stop_process
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration
ARGS = {"num_examples": 20}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("env_server")
    build_tiny_model(root / "model")
    server = Server(root / "model", root, root / "inference.log")
    yield server
    server.stop()


def start_env_server(tmp_path, workers: int) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{tmp_path}/reverse-text.sock"
    log = open(tmp_path / "env-server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "rl.envs.server", "--env.id", "reverse-text", "--env.args", str(ARGS).replace("'", '"'),
         "--workers", str(workers), "--address", address], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return process, address


def train_client(server) -> vf.TrainClientConfig:
    renderer = renderer_config("auto", str(server.model))[0]
    # the variable rl's env server lets a request's client read (`client_env_vars`), not verifiers' PRIME_API_KEY
    return vf.TrainClientConfig(base_url=f"{server.url}/v1", renderer=renderer, renderer_model_name=str(server.model),
                                api_key_var=API_KEY_VAR)


def test_episodes_run_in_the_pools_workers_and_come_back_as_token_samples(server, tmp_path):
    environment = load_environment(EnvConfig(id="reverse-text", args=ARGS))  # the orchestrator's side: the taskset
    process, address = start_env_server(tmp_path, workers=2)

    async def go():
        client = EnvClient(address)
        try:
            await client.wait_for_server_startup(timeout=120)
            sampling = vf.SamplingConfig(temperature=1.0, max_tokens=12)
            tasks = [environment.task(i) for i in range(4)]
            deltas = [[] for _ in tasks]
            episodes = await asyncio.gather(*(
                client.run(train_client(server), str(server.model), sampling, task.data.model_dump(), seen.append)
                for task, seen in zip(tasks, deltas)))
            return tasks, episodes, deltas
        finally:
            await client.close()

    try:
        tasks, episodes, deltas = asyncio.run(go())
    finally:
        stop_process(process)
    log = (tmp_path / "env-server.log").read_text()
    for i, (task, episode) in enumerate(zip(tasks, episodes)):
        result = to_result(i, task, episode)
        assert result.segments and 0.0 <= result.reward <= 1.0
        segment = result.segments[0]
        assert segment.prompt_ids and 1 <= len(segment.completion_ids) <= 12
        assert all(lp <= 0.0 for lp in segment.completion_logprobs)
        # every sampled token was labelled with the step that sampled it, stamped in the worker, sent with the trace
        assert [v for v, m in zip(segment.completion_versions, segment.completion_mask) if m] == [0] * sum(
            segment.completion_mask)
        # each trace crosses the wire once, whole, when its episode ends (rl.patches.send_traces_once)
        assert [delta["trace"] for delta in deltas[i]] == [trace.id for trace in episode.traces]
        assert "open" in deltas[i][0] and len(deltas[i][0]["nodes"]) == len(episode.traces[0].nodes)
    assert "2 workers; seat 'agent': harness 'reverse-text'" in log, log[-2000:]
    workers = set(re.findall(r"env-server\[(\d+)\] INFO EnvServer up: taskset=reverse-text address=ipc://", log))
    assert len(workers) == 2, log[-2000:]  # each its own process, loaded before the first episode was sent


def test_a_group_goes_to_a_worker_as_one_request_and_its_episodes_come_back_whole(server, tmp_path, monkeypatch):
    """rl's `run_group` (rl/envs/groups.py): each group one request, answered with its episodes whole; an episode
    crosses as verifiers' client would assemble it from its deltas (compared on episodes run in this process)."""
    apply_patches()
    process, address = start_env_server(tmp_path, workers=2)
    client = InferenceClient(server.url, str(server.model), str(server.model),
                             renderer_config("auto", str(server.model))[0])
    served, local = (load_environment(EnvConfig(id="reverse-text", args=ARGS, workers=w)) for w in (1, 0))
    served.runner = ServedEpisodes("reverse-text", address)
    sent = []
    run_request = GroupClient.run_group

    async def counted(self, request):
        sent.append(len(request.samplings))
        return await run_request(self, request)

    monkeypatch.setattr(GroupClient, "run_group", counted)

    async def go():
        await served.runner.start(120)
        try:
            groups = await asyncio.gather(*(run_group(served, i, 4, client, Sampling(max_tokens=12)) for i in range(3)))
        finally:
            await served.runner.close()
        async with local.serving():
            contexts = [*model_contexts(client, Sampling(max_tokens=12), 2), *model_contexts(client, Sampling(), 1)]
            # one at a time: renderers' first lookup of a server's context length takes a lock of the module's,
            # which binds to the event loop that first waits on it, and later tests of this process run other loops
            return groups, [await local.env.run_slot(slot, ctx)
                            for slot, ctx in zip(local.env.slots(local.task(0), 3), contexts)]

    try:
        groups, here = asyncio.run(go())
    finally:
        stop_process(process)
    assert sent == [4, 4, 4]
    for i, results in enumerate(groups):
        assert len(results) == 4 and all(r.task_index == i and r.segments for r in results)
        assert all(1 <= len(r.segments[0].completion_ids) <= 12 and 0.0 <= r.reward <= 1.0 for r in results)
    configs = AgentConfigs()
    for episode in here:
        assert unpack(pack(episode_record(episode))) == unpack(pack(assembled_from_deltas(episode)))
        record = unpack(pack(episode_record(episode)))
        assert configs.episode(record) == WireEpisode.model_validate(unpack(pack(episode_record(episode))))
    assert len(configs.validated) == 2  # a group's episodes share their agent config: validated once


def assembled_from_deltas(episode: vf.Episode) -> dict:
    """An episode as verifiers' own client assembles it from the deltas its server sends (verifiers.v1.serve)."""
    assembly = EpisodeAssembly()
    for _, delta, _ in DeltaStreamer(lambda: episode.traces, None).diff():
        assembly.apply(delta)
    sizes = [TraceSummary(id=trace.id, nodes=len(trace.nodes), calls=len(trace.calls)) for trace in episode.traces]
    return assembly.finish(dump(episode, exclude={"traces"}), sizes)


def test_a_wrong_env_table_fails_the_start_naming_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rl.envs.server", "--env.id", "reverse-text", "--env.args",
                           '{"num_examples": "many"}', "--address", f"ipc://{tmp_path}/x.sock"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "num_examples" in done.stderr, done.stderr[-2000:]


def test_a_worker_then_the_whole_env_server_killed_mid_run_restart_it_and_the_run_goes_on(tiny_model, tmp_path):
    """SIGKILL one of an env server's two workers while the orchestrator generates, then the restarted server itself:
    each time `rl` restarts it, the episodes it held fail fast and their groups run again, and every step trains."""
    served = tmp_path / "served.toml"
    served.write_text('[[env]]\nid = "reverse-text"\nargs = { num_examples = 200 }\nworkers = 2\n')
    out = tmp_path / "run"
    steps = 12  # room after the second kill: the orchestrator must still need the third server to finish
    run = Launched(rl_command(tiny_model, out, steps, "--orchestrator", "@", served))
    wait_for_line(run, "step 1 orchestrator")
    server = psutil.Process(run.child_pid("env-reverse-text"))
    workers = server.children()  # forked from it (rl.patches.fork_pool_workers)
    assert len(workers) == 2, (workers, run.output[-3000:])
    workers[0].kill()
    wait_for_line(run, "restarting it (1 of at most 5 restarts)")
    step = len(re.findall(r"step \d+ orchestrator", run.output))
    wait_for_line(run, f"step {step + 1} orchestrator")  # the restarted server's episodes reach a batch
    assert step + 1 <= steps - 3, f"the run reached step {step + 1} of {steps} before the second kill"
    restarted = psutil.Process(run.child_pid("env-reverse-text"))
    its_workers = restarted.children()
    restarted.kill()
    code = run.wait(timeout=600)
    assert code == 0, run.output[-5000:]
    assert re.search(r"rl: env-reverse-text .*; restarting it \(1 of at most 5 restarts\)", run.output), run.output
    assert re.search(r"rl: env-reverse-text was killed by SIGKILL; restarting it \(2 of at most 5", run.output)
    assert not [p for p in its_workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # gone with it
    log = (out / "logs" / "env-reverse-text.log").read_text()
    assert f"(pid {workers[0].pid}) died" in log and len(re.findall("EnvServerPool up", log)) == 3, log[-3000:]
    orchestrator = (out / "logs" / "orchestrator.log").read_text()
    assert "was restarted: this group's episodes were lost with it" in orchestrator  # failed fast, its group run again
    records = [m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"]
    assert [m["step"] for m in records] == list(range(steps))


def wait_for_line(run: Launched, text: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in run.output and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text in run.output, f"no {text!r} within {timeout_s} s:\n{run.output[-3000:]}"
