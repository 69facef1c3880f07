"""End-of-run summary: start and final reward, steps, time, time left to max_steps, and reward.png (reward and loss
per step). The time left is also what each of the launcher's step lines says (supervisor.py)."""

from __future__ import annotations

import json
import statistics

from rl.atomic import atomic_write
from rl.metrics_file import read_metrics
from rl.protocol import RunPaths, atomic_write_text

PACE_WINDOW = 5
"""Steps the pace is measured over: the mean interval between the trainer's last PACE_WINDOW + 1 step records."""


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


def seconds_per_step(times: list[float]) -> float | None:
    """The recent pace: the mean interval between the last PACE_WINDOW + 1 of `times` (the trainer's step records'
    wall times, in step order), i.e. (last - first) / intervals over that window. The trainer's steps are what
    max_steps counts (the orchestrator runs up to async_level steps ahead of them); a window of a few steps follows a
    change of pace (episodes growing longer, an eval step) and smooths a single slow step. None before two steps
    are done: one record has no interval to go by."""
    recent = times[-(PACE_WINDOW + 1):]
    if len(recent) < 2:
        return None
    return max(recent[-1] - recent[0], 0.0) / (len(recent) - 1)


def time_left_s(records: list[dict], max_steps: int, since: float | None = None) -> float | None:
    """Seconds to max_steps at the recent pace: the steps not yet trained (after the trainer's last step record)
    times seconds_per_step of the trainer's records written at or after `since` (a launch's start: a resumed run's
    pause between launches is no step's time); 0 once max_steps is trained, None while there is no pace yet."""
    trainer = {r["step"]: r.get("time") for r in records if r.get("process") == "trainer"}
    left = max_steps - (max(trainer) + 1 if trainer else 0)
    if left <= 0:
        return 0.0
    times = [t for _, t in sorted(trainer.items()) if isinstance(t, (int, float)) and (since is None or t >= since)]
    pace = seconds_per_step(times)
    return None if pace is None else left * pace


def duration(seconds: float) -> str:
    """42s, 3m05s, 2h03m, 1d04h: as precise as a glance at a long run needs."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def progress(elapsed_s: float, left_s: float | None) -> str:
    """What a step line and the summary say of the time: elapsed, and the estimate when there is one."""
    if left_s is None:
        return f"{duration(elapsed_s)} elapsed, time left: no estimate before 2 trainer steps"
    if left_s == 0:
        return f"{duration(elapsed_s)} elapsed, max_steps reached"
    return f"{duration(elapsed_s)} elapsed, ~{duration(left_s)} left"


def summary_of(records: list[dict], elapsed_s: float, max_steps: int | None = None,
               since: float | None = None) -> dict:
    """The summary of `records` (nothing written): steps trained, the reward's change, the time and the time left."""
    reward = per_step(records, "orchestrator", "reward")
    steps = sorted(reward)
    summary: dict = {"steps": len(per_step(records, "trainer", "loss")) if steps else 0}
    if steps:
        summary |= reward_change([reward[s] for s in steps])
    summary["time_s"] = elapsed_s
    if max_steps is not None:
        summary |= {"max_steps": max_steps, "time_left_s": time_left_s(records, max_steps, since)}
    return summary


def summarize(paths: RunPaths, elapsed_s: float, max_steps: int | None = None, since: float | None = None) -> dict:
    """summary_of the run's records; with any step done, written to summary.json, and reward.png drawn."""
    records = read_metrics(paths)
    summary = summary_of(records, elapsed_s, max_steps, since)
    if "start_reward" in summary:
        atomic_write_text(paths.summary, json.dumps(summary, indent=1) + "\n")
        plot(paths, per_step(records, "orchestrator", "reward"), per_step(records, "trainer", "loss"))
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
    time = (progress(summary["time_s"], summary["time_left_s"]) if "max_steps" in summary
            else f"{duration(summary['time_s'])} elapsed")
    if not summary.get("steps"):
        return f"no steps finished; {time}"
    return (
        f"{summary['steps']} steps in {summary['time_s']:.0f}s; reward {summary['start_reward']:.3f} "
        f"(first {summary['window']} steps) -> {summary['final_reward']:.3f} (last {summary['window']}), "
        f"gain {summary['reward_gain']:+.3f} against noise {summary['noise_3se']:.3f} (3 standard errors); {time}"
    )
