"""`eval`: evaluate a model on verifiers environments.

    uv run eval @ eval.toml --model.name outputs/run/weights/step_60 --rollouts-per-example 4
    uv run eval @ eval.toml --model.name models/tiny --adapter outputs/lora/weights/step_60   (a LoRA adapter)

    uv run eval @ eval.toml --client.base-url http://127.0.0.1:8000 --model.name Qwen/Qwen3-0.6B   (a `vllm serve`)
    OPENAI_API_KEY=... uv run eval @ eval.toml --client.base-url https://api.openai.com/v1 \
        --client.api-key-var OPENAI_API_KEY --model.name gpt-4o-mini                           (a hosted API)

The model is a Hugging Face directory (a run's `weights/step_k` is one), served by rl's inference server that
eval starts (`[inference]`) and sampled token by token as training samples it; or any OpenAI-compatible server
already running (`--client.base-url`), sampled through chat completions (`client.api`). Every task of every
`[[env]]` (the first `num_examples`) gets `rollouts_per_example` rollouts, scored by the environment. Written to
`output_dir`: `results.jsonl` (one line per rollout: reward, components, metrics, pass, prompt and completion:
text, or chat messages with the chat api) and `summary.json` (per environment and overall: mean reward,
components, metrics, pass@k, avg@n).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path


from rl.config import ConfigError, run_cli, url_without_password, write_config
from rl.inference.config import LoraServingConfig
from rl.eval.config import EvalCommandConfig
from rl.eval.serving import (
    EvalError, check_adapter, check_api_key_var, check_served, check_weights, load_adapter, stage_adapter,
    start_server, wait_for_models, wait_for_own_server,
)
from rl.checks import check_model
from rl.metrics import PER_REQUEST_LOGGERS, setup_logging
from rl.envs.loading import (
    EnvLoadError, Environment, launched, load_environments, serving,
)
from rl.orchestrator.eval import EvalGroups, eval_stats, group_scores, run_eval_groups
from rl.envs.rollouts import ChatClient, InferenceClient, RolloutResult, openai_api_root
from rl.envs.process_setup import apply_patches
from rl.envs.slots import RolloutSlots
from rl.renderer import chat_renderer, load_tokenizer
from rl.renderer import describe as describe_renderer
from rl.orchestrator.stats import mean, means, tool_stats
from rl.protocol import atomic_write_text
from rl.process import set_up_process

RESULTS = "results.jsonl"
SUMMARY = "summary.json"


def output_dir(config: EvalCommandConfig) -> Path:
    """The results directory: a new one, or one that holds no results yet (nothing is overwritten)."""
    out = config.output_dir or Path("outputs") / f"eval-{datetime.now():%Y%m%d-%H%M%S}"
    taken = [name for name in (RESULTS, SUMMARY) if (out / name).exists()]
    if taken:
        raise ConfigError(f"output_dir {out} already holds {taken[0]}; choose another --output-dir or delete it")
    return out


async def run(
    config: EvalCommandConfig, envs: list[Environment], client: InferenceClient | ChatClient, logger
) -> EvalGroups:
    slots = RolloutSlots(config.max_concurrent)
    async with serving(envs):
        return await run_eval_groups(
            config, envs, config.num_examples, [client], slots, config.rollout.timeout_s,
            config.rollout.max_retries, logger.warning,
        )


def rollout_records(evaluated: EvalGroups, threshold: float, decode) -> list[dict]:
    return [
        rollout_record(name, result.task_index, j, result, threshold, decode)
        for name, env_groups in evaluated.groups.items()
        for group in env_groups
        for j, result in enumerate(group)
    ]


def rollout_record(name: str, task_index: int, j: int, r: RolloutResult, threshold: float, decode) -> dict:
    return {
        "env": name,
        "task_index": task_index,
        "task_id": r.task_id,
        "rollout": j,
        "reward": r.reward,
        "passed": r.reward >= threshold,
        "rewards": r.rewards,
        "metrics": r.metrics,
        "num_turns": r.num_turns,
        "tool_calls": r.tool_calls,
        "tool_errors": r.tool_errors,
        "truncated": r.is_truncated,
        "completion_tokens": r.sampled_tokens,
        **conversation(r, decode),
    }


def conversation(r: RolloutResult, decode) -> dict:
    """What the model saw and wrote: a chat rollout's messages, else the text of its tokens."""
    if r.chat is not None:
        return {"prompt": r.chat.prompt, "completion": r.chat.completion}
    return {"prompt": decode(r.segments[0].prompt_ids), "completion": decode(r.segments[-1].completion_ids)}


def summarize(evaluated: EvalGroups, config: EvalCommandConfig, elapsed_s: float) -> dict:
    """Per environment and overall: tasks, rollouts, mean reward, components, metrics, pass@k, avg@n, and the
    groups dropped after their retries (with their errors). An environment whose every group was dropped
    has no reward."""
    per_env = {}
    for name, env_groups in evaluated.groups.items():
        results = [r for g in env_groups for r in g]
        dropped = evaluated.dropped[name]
        per_env[name] = {
            "tasks": len(env_groups) + len(dropped),
            "rollouts": len(results),
            "dropped": len(dropped) * evaluated.group_size,
            "reward": mean([r.reward for r in results]) if results else None,
            **group_scores(env_groups, config.pass_threshold),
            **{f"reward/{k}": v for k, v in means(r.rewards for r in results).items()},
            **{f"metric/{k}": v for k, v in means(r.metrics for r in results).items()},
            "turns": mean([r.num_turns for r in results]),
            **{f"tools/{k}": v for k, v in tool_stats(results).items()},
            **({"errors": sorted(set(dropped))} if dropped else {}),
        }
    overall = eval_stats(evaluated, config.pass_threshold, prefix="")
    return {
        "model": config.model.name,
        "adapter": str(config.adapter) if config.adapter else None,
        "api": config.client.resolved_api(),
        "rollouts_per_example": config.rollouts_per_example,
        "pass_threshold": config.pass_threshold,
        "sampling": config.sampling.model_dump(mode="json"),
        "time_s": elapsed_s,
        "envs": per_env,
        "overall": {k: v for k, v in overall.items() if "/" not in k},
    }


def format_table(summary: dict) -> str:
    keys = score_keys(summary)
    rows = [("env", "tasks", "rollouts", "dropped", "reward", *keys)]
    for name, env in summary["envs"].items():
        scores = (env.get(k, "-") for k in keys)
        rows.append((name, env["tasks"], env["rollouts"], env["dropped"], env["reward"], *scores))
    widths = [max(len(_cell(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(_cell(v).ljust(w) for v, w in zip(row, widths)) for row in rows)


def score_keys(summary: dict) -> list[str]:
    """pass@k and avg@n, in order, of every environment that has them (none where all groups were dropped)."""
    keys = [k for env in summary["envs"].values() for k in env if k.startswith(("pass@", "avg@"))]
    return list(dict.fromkeys(keys))


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_results(out: Path, records: list[dict], summary: dict) -> None:
    atomic_write_text(out / RESULTS, "".join(json.dumps(r) + "\n" for r in records))
    atomic_write_text(out / SUMMARY, json.dumps(summary, indent=2) + "\n")


def inference_client(config: EvalCommandConfig, url: str, served: str, envs: list[Environment], logger):
    """The chat client, or the token client with the model's renderer."""
    if config.client.resolved_api() == "chat":
        logger.info(f"sampling {served!r} through chat completions at {url_without_password(openai_api_root(url))}")
        return ChatClient(url, served, config.client.api_key_var, config.client.max_reply_bytes,
                          config.rollout.timeout_s)
    renderer, why = chat_renderer(config.model.renderer, config.model.name, envs)
    logger.info(f"model {config.model.name!r} renders with {describe_renderer(renderer)} ({why})")
    return InferenceClient(url, served, config.model.name, renderer, config.client.api_key_var)


def evaluate(config: EvalCommandConfig, envs: list[Environment], out: Path, logger) -> dict:
    step = stage_adapter(config.adapter, out) if config.adapter is not None else None
    supervisor, url = (None, config.client.base_url) if config.client.base_url else start_server(config, out)
    served = config.client.served_model or config.model.name
    if supervisor is not None and config.inference.api_key:  # the server eval starts requires its key
        os.environ[config.client.api_key_var] = config.inference.api_key
    try:
        with launched(envs):  # they load while inference starts
            logger.info(f"waiting for inference server {url_without_password(url)}")
            if supervisor is None:
                api_root = openai_api_root(url)
                check_served(api_root, served, wait_for_models(api_root, config.client.api_key_var,
                                                               config.client.startup_timeout_s), logger)
            else:
                wait_for_own_server(url.rstrip("/"), config.client.startup_timeout_s, supervisor)
            if step is not None:
                reply = load_adapter(url.rstrip("/"), step)
                served = reply.get("adapter") or LoraServingConfig().name
                logger.info(f"serving adapter {config.adapter} as {served!r} (checksum "
                            f"{reply.get('weights_checksum')})")
            client = inference_client(config, url, served, envs, logger)
            start = time.perf_counter()
            evaluated = asyncio.run(run(config, envs, client, logger))
            elapsed = time.perf_counter() - start
    finally:
        if supervisor is not None:
            supervisor.stop_all()
    decode = load_tokenizer(config.model.name).decode if isinstance(client, InferenceClient) else None
    records = rollout_records(evaluated, config.pass_threshold, decode)
    summary = summarize(evaluated, config, elapsed)
    write_results(out, records, summary)
    if not records and any(evaluated.dropped.values()):
        raise EvalError(nothing_finished(config, url, served, evaluated, out))
    return summary


def nothing_finished(config: EvalCommandConfig, url: str, served: str, evaluated: EvalGroups, out: Path) -> str:
    first_error = next(error for dropped in evaluated.dropped.values() for error in dropped)
    hint = ""
    if config.client.base_url is not None and config.client.resolved_api() == "tokens":
        hint = ("; client.api = 'tokens' needs rl's inference server, set client.api = 'chat' for any other "
                "OpenAI-compatible server")
    return (f"every rollout failed on {url_without_password(url)} (model {served!r}, api "
            f"{config.client.resolved_api()!r}; the errors are in {out / SUMMARY}). The first: {first_error}{hint}")


def main(argv: list[str] | None = None) -> None:
    set_up_process()
    apply_patches()
    config = run_cli(EvalCommandConfig, argv)
    logger = setup_logging("eval", quiet=PER_REQUEST_LOGGERS)
    try:
        out = output_dir(config)
        if config.client.base_url is None:
            check_model(config.model.name)
            check_weights(config.model.name)
            if config.adapter is not None:
                check_adapter(config.adapter)
        check_api_key_var(config.client.api_key_var)
        envs = load_environments(config.env, "env")
        if config.client.resolved_api() == "tokens":
            chat_renderer(config.model.renderer, config.model.name, envs)
    except (ConfigError, EnvLoadError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    out.mkdir(parents=True, exist_ok=True)
    write_config(config, out / "configs" / "eval.toml", mask_secrets=True)  # a record: nothing reads it back
    for env in envs:
        logger.info(env.describe())
    try:
        summary = evaluate(config, envs, out, logger)
    except EvalError as e:
        print(f"eval: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(format_table(summary))
    print(f"eval: {sum(e['rollouts'] for e in summary['envs'].values())} rollouts in {summary['time_s']:.0f}s; "
          f"{out / RESULTS}, {out / SUMMARY}")


if __name__ == "__main__":
    main()
