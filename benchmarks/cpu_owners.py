"""Whose code a process's CPU went to: shares of a py-spy profile by the package that owns each sample.

Each busy sample (its innermost frame not a wait: select, epoll, a lock, a sleep) goes to the innermost frame that
belongs to a named owner (rl, verifiers, renderers, the environment, transformers); samples with none, the event
loop itself and the libraries it runs, are "event loop and libraries". Samples whose stack holds one of `--skip`
are left out: by default the benchmark's raw side and one-off work (imports, `tune_gc_for_serving`, the server's
start). Per owner, the innermost frames that took the most.

    pip install py-spy   # not a dependency of rl
    py-spy record -r 250 -f raw -o /tmp/orch.txt -- \
        .venv/bin/python benchmarks/orchestrator_throughput.py --model /tmp/tiny --repeats 3
    .venv/bin/python benchmarks/cpu_owners.py /tmp/orch.txt
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWNERS = {  # a frame's top-level package (py-spy prints `name (package/module.py:line)`) -> its owner
    **{p.name: "the environment" for p in (ROOT / "environments").iterdir() if p.is_dir()},
    "rl": "rl",
    "in_process_chat": "rl",  # rl's harness, packaged as an environment
    "verifiers": "verifiers",
    "renderers": "renderers",
    "transformers": "transformers",
    "tokenizers": "transformers",
}
WAITS = ("select", "epoll", "poll (", "wait (", "_wait_for_tstate_lock", "acquire", "sleep", "thread.py:81")
UNOWNED = "event loop and libraries"


def owner_of(frame: str) -> str | None:
    package = frame.rpartition(" (")[2].partition("/")[0]
    return OWNERS.get(package)


def innermost_owned(frames: list[str]) -> tuple[str, str]:
    for frame in reversed(frames):
        if owner := owner_of(frame):
            return frame, owner
    return frames[-1], UNOWNED


def busy_samples(path: str, skip: list[str]):
    """(frames outermost first, count) for each busy stack of a py-spy raw file."""
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if any(wait in frames[-1] for wait in WAITS) or any(part in stack for part in skip):
                continue
            yield frames, int(count)


def attribute(samples) -> dict[str, collections.Counter]:
    """Per owner, the busy samples of each of its innermost frames."""
    frames_by_owner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, count in samples:
        frame, owner = innermost_owned(frames)
        frames_by_owner[owner][frame] += count
    return frames_by_owner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a py-spy raw profile (`py-spy record -f raw`)")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=["raw_side", "<frozen importlib", "tune_gc_for_serving", "inference_server.py"],
        help="leave out samples whose stack holds any of these (none: keep all)",
    )
    parser.add_argument("--top", type=int, default=8, help="frames shown per owner")
    args = parser.parse_args()
    frames_by_owner = attribute(busy_samples(args.profile, args.skip))
    by_owner = collections.Counter({owner: frames.total() for owner, frames in frames_by_owner.items()})
    total = by_owner.total()
    if not total:
        raise SystemExit(f"{args.profile}: no busy samples")
    print(f"{total} busy samples")
    for owner, count in by_owner.most_common():
        print(f"{100 * count / total:5.1f}% {owner}")
        for frame, n in frames_by_owner[owner].most_common(args.top):
            print(f"        {100 * n / total:5.1f}% {frame[:140]}")


if __name__ == "__main__":
    main()
