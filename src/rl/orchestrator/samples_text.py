"""A few of each step's rollouts as text (issue 90): `samples/step_k.jsonl`, one JSON object per rollout, the
same rows as W&B's `orchestrator/samples` table and `rl report`'s samples. Per environment, the kept rollouts that
`samples.picks` names: the best and worst by reward, and one drawn at random (seeded by step and environment).

A rollout's record: its environment, task, reward and reward components, metrics, turns, the policy versions that
sampled it, its lengths in tokens, and its text: the prompt, then the completion split where its tokens change
hands (the model's turns, the environment's replies between them), each decoded. A text longer than
`samples.max_chars` keeps its start and end with a marker in between that says how much was cut."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from rl.atomic import atomic_write_text
from rl.envs.rollouts import RolloutResult, TokenSegment
from rl.protocol import RunPaths

COLUMNS = ["step", "env", "pick", "task_id", "reward", "prompt", "completion"]


def picked(results: list[RolloutResult], picks: list[str], rng: random.Random) -> list[tuple[str, RolloutResult]]:
    """(pick, rollout) for each pick, from an environment's kept rollouts; a rollout picked twice is written once."""
    if not results:
        return []
    chosen = {"best": lambda: max(results, key=lambda r: r.reward),
              "worst": lambda: min(results, key=lambda r: r.reward), "random": lambda: rng.choice(results)}
    out, seen = [], set()
    for pick in picks:
        result = chosen[pick]()
        if id(result) not in seen:
            seen.add(id(result))
            out.append((pick, result))
    return out


def cut(text: str, max_chars: int) -> str:
    """`text`, or its start and end around a marker saying how many characters were cut."""
    if len(text) <= max_chars:
        return text
    keep = max_chars // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters cut ...]\n{text[len(text) - keep:]}"


def turns(segment: TokenSegment, decode: Callable[[list[int]], str], max_chars: int) -> list[dict]:
    """The completion as runs of tokens the model sampled (`model`) and the environment inserted (`env`)."""
    runs: list[dict] = []
    for token, sampled in zip(segment.completion_ids, segment.completion_mask, strict=True):
        who = "model" if sampled else "env"
        if not runs or runs[-1]["role"] != who:
            runs.append({"role": who, "ids": []})
        runs[-1]["ids"].append(token)
    return [{"role": run["role"], "text": cut(decode(run["ids"]), max_chars)} for run in runs]


def rollout_record(step: int, env: str, pick: str, result: RolloutResult, decode: Callable[[list[int]], str],
                   max_chars: int) -> dict:
    segments = result.segments
    versions = sorted({v for s in segments for v in s.completion_versions if v is not None})
    record = {
        "step": step, "env": env, "pick": pick, "task_id": result.task_id, "reward": result.reward,
        "rewards": result.rewards, "metrics": result.metrics, "num_turns": result.num_turns,
        "truncated": result.is_truncated, "policy_versions": [versions[0], versions[-1]] if versions else None,
        "prompt_tokens": len(segments[0].prompt_ids) if segments else 0, "completion_tokens": result.sampled_tokens,
    }
    if result.chat is not None:  # a chat rollout: its messages, no token ids
        return record | {"prompt": cut(json.dumps(result.chat.prompt), max_chars),
                         "turns": [{"role": m.get("role", "?"), "text": cut(str(m.get("content")), max_chars)}
                                   for m in result.chat.completion]}
    return record | {"prompt": cut(decode(segments[0].prompt_ids), max_chars),
                     "turns": [turn for segment in segments for turn in turns(segment, decode, max_chars)]}


def step_samples(step: int, kept: dict[str, list[RolloutResult]], picks: list[str], max_chars: int, seed: int,
                 decode: Callable[[list[int]], str]) -> list[dict]:
    records = []
    for env, results in sorted(kept.items()):
        rng = random.Random(f"samples:{seed}:{step}:{env}")
        records += [rollout_record(step, env, pick, result, decode, max_chars)
                    for pick, result in picked(results, picks, rng)]
    return records


def write_samples(paths: RunPaths, step: int, records: list[dict]) -> None:
    atomic_write_text(paths.samples(step), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def table_rows(records: list[dict]) -> list[list]:
    """The records as W&B table rows (`COLUMNS`): the completion's turns joined, each marked with its role."""
    return [[r["step"], r["env"], r["pick"], r["task_id"], r["reward"], r["prompt"],
             "\n".join(f"[{t['role']}] {t['text']}" for t in r["turns"])] for r in records]
