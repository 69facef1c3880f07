"""End-of-run summary: start and final reward, steps, time, and reward.png (reward and loss per step)."""

from __future__ import annotations

import json
import statistics

from rl.atomic import atomic_write
from rl.metrics_file import read_metrics
from rl.protocol import RunPaths, atomic_write_text


def per_step(records: list[dict], process: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if r.get("process") == process and isinstance(r.get(key), (int, float))}


def reward_change(rewards: list[float]) -> dict:
    """Mean step reward of the first and last fifth of the steps (at least 3 each), their difference and
    the noise: three standard errors of that difference, from the spread of step rewards in each window.
    A gain above the noise is a rise that chance alone would rarely show."""
    window = max(3, len(rewards) // 5)
    head, tail = rewards[:window], rewards[-window:]
    spread = sum(statistics.variance(w) / len(w) if len(w) > 1 else 0.0 for w in (head, tail))
    start, final = statistics.fmean(head), statistics.fmean(tail)
    return {"start_reward": start, "final_reward": final, "window": window,
            "reward_gain": final - start, "noise_3se": 3 * spread**0.5}


def summarize(paths: RunPaths, elapsed_s: float) -> dict:
    records = read_metrics(paths)
    reward = per_step(records, "orchestrator", "reward")
    steps = sorted(reward)
    if not steps:
        return {"steps": 0, "time_s": elapsed_s}
    summary = {
        "steps": len(per_step(records, "trainer", "loss")),
        **reward_change([reward[s] for s in steps]),
        "time_s": elapsed_s,
    }
    atomic_write_text(paths.summary, json.dumps(summary, indent=1) + "\n")
    plot(paths, reward, per_step(records, "trainer", "loss"))
    return summary


def plot(paths: RunPaths, reward: dict[int, float], loss: dict[int, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(list(reward), list(reward.values()), marker="o", color="tab:green")
    top.set_ylabel("mean reward")
    top.grid(alpha=0.3)
    bottom.plot(list(loss), list(loss.values()), marker="o", color="tab:blue")
    bottom.set_ylabel("trainer loss")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.suptitle(paths.root.name)
    fig.tight_layout()
    atomic_write(paths.reward_plot, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def format_summary(summary: dict) -> str:
    if not summary.get("steps"):
        return f"no steps finished in {summary['time_s']:.0f}s"
    return (
        f"{summary['steps']} steps in {summary['time_s']:.0f}s; reward {summary['start_reward']:.3f} "
        f"(first {summary['window']} steps) -> {summary['final_reward']:.3f} (last {summary['window']}), "
        f"gain {summary['reward_gain']:+.3f} against noise {summary['noise_3se']:.3f} (3 standard errors)"
    )
