"""A CPU inference server's start, phase by phase, and its raw tokens/s, with vLLM's processes spawned or forked.

Each round starts rl's server (`python -m rl.inference.main`, tests' Server helper) once per start method, one after
the other, alternating which goes first: spawned (VLLM_WORKER_MULTIPROC_METHOD=spawn, vLLM's own choice on CPU) and
forked (rl's default on CPU hosts, `rl.patches.vllm_cpu_fork`). For each start it prints when each phase ended,
in seconds from the command's start, read from the server's log (whole seconds: vLLM's log stamps) and the health
wait (exact):

    api      vLLM's API server has imported vLLM and parsed its arguments (its first log line)
    engine   the engine core process logs its first line (spawned: after importing vLLM again)
    worker   the worker process logs its first line (spawned: after importing vLLM, torch, transformers again)
    loaded   the worker has loaded the weights
    warm     the engine's profile, KV cache and warm-up are done
    healthy  /health answers 200 (rl's own wait, `rl.health.wait_healthy`)

then the server's raw tokens/s: `--requests` generate requests of exactly `--max-tokens` tokens, `--concurrency` in
flight, the best of `--repeats`. The last lines give, per method, the median healthy time and tokens/s over the
rounds, and forked over spawned.

    uv run --no-sync python benchmarks/server_start.py --model /tmp/tiny --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("spawn", "fork")
PHASES = {  # phase: the first log line that ends it
    "api": re.compile(r"^\(APIServer pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)"),
    "engine": re.compile(r"^\(EngineCore pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)"),
    "worker": re.compile(r"^\((?:VllmWorker-\d+|Worker(?:_TP\d+)?) pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)"),
    "loaded": re.compile(r"\w+ (\d\d-\d\d \d\d:\d\d:\d\d) \[default_loader.py:\d+\] Loading weights took"),
    "warm": re.compile(r"\w+ (\d\d-\d\d \d\d:\d\d:\d\d) \[core.py:\d+\] init engine"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory (tokenizer included)")
    parser.add_argument("--rounds", type=int, default=3, help="starts per method, alternated")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="throughput measurements per start; the best counts")
    return parser.parse_args()


def phase_ends(log: Path, started: float) -> dict[str, float]:
    """Each phase's end in seconds after `started` (a wall-clock time), from the first log line that ends it."""
    year = datetime.date.today().year
    ends: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        for phase, pattern in PHASES.items():
            if phase not in ends and (match := pattern.search(line)):
                stamp = datetime.datetime.strptime(f"{year}-{match.group(1)}", "%Y-%m-%d %H:%M:%S")
                ends[phase] = stamp.timestamp() - started
    return ends


async def tokens_per_s(args, url: str, model: str) -> float:
    semaphore = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:

        async def one(i: int) -> int:
            body = {"model": model, "token_ids": [5 + i % 50, 7, 9, 11], "sampling_params": {
                "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "temperature": 1.0, "logprobs": 1,
                "seed": i}}
            async with semaphore:
                response = await http.post(f"{url}/inference/v1/generate", json=body)
            response.raise_for_status()
            return len(response.json()["choices"][0]["token_ids"])

        await one(0)
        best = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(args.requests))))
            best = max(best, tokens / (time.perf_counter() - start))
    return best


def one_start(args, method: str, tmp: Path) -> tuple[dict[str, float], float]:
    from tests.integration.inference_server import Server

    log = tmp / f"{method}.log"
    started = time.time()
    server = Server(Path(args.model), tmp, log, env={"VLLM_WORKER_MULTIPROC_METHOD": method} if method == "spawn"
                    else {})
    try:
        ends = phase_ends(log, started) | {"healthy": time.time() - started}
        return ends, asyncio.run(tokens_per_s(args, server.url, str(server.model)))
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        sys.exit("unset VLLM_WORKER_MULTIPROC_METHOD: this benchmark sets it per start")
    healthy: dict[str, list[float]] = {m: [] for m in METHODS}
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    print("round method " + " ".join(f"{p:>7}" for p in [*PHASES, "healthy"]) + "  tokens/s")
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for method in METHODS if round_ % 2 == 0 else reversed(METHODS):
                ends, rate = one_start(args, method, Path(tmp))
                healthy[method].append(ends["healthy"])
                rates[method].append(rate)
                cells = " ".join(f"{ends[p]:7.1f}" if p in ends else "      -" for p in [*PHASES, "healthy"])
                print(f"{round_:5} {method:6} {cells}  {rate:8.0f}", flush=True)
    for method in METHODS:
        print(f"{method}: healthy after {statistics.median(healthy[method]):.1f} s, "
              f"{statistics.median(rates[method]):.0f} tokens/s (medians of {args.rounds})")
    ratios = [f / s for f, s in zip(rates["fork"], rates["spawn"])]
    start_ratio = statistics.median(healthy["fork"]) / statistics.median(healthy["spawn"])
    print(f"fork over spawn: healthy {start_ratio:.2f}x, tokens/s {statistics.median(ratios):.2f}x "
          f"(median of the rounds' ratios, {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
