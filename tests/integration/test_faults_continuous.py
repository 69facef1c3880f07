"""kill -9 of every role of a 100-step run with continuous dispatch, each at a random moment: every drawn task is
trained once.

One run directory goes through six faults in turn, at random steps spread over the run: the orchestrator, a trainer
rank, the inference server's API process and its engine core (each ends the run, which is resumed from its newest
checkpoint), an environment's server and one of its workers (the launcher starts the server again, and the run
goes on). Each run that a fault ends must stop within STOP_WITHIN_S and leave no process behind; the last one
finishes the 100 steps.

What was trained is read from the batches' STABLE markers (`groups`: each group's environment, task and rollouts
kept): over the steps and the final checkpoint's groups not yet trained (`pending`), every task the sampler drew
(its position in the final checkpoint) appears exactly once, none twice and none lost; every step has one batch
and one record per process. Set RL_FAULT_SEED to replay the moments of a failed run.
"""

import collections
import os
import random
import re
import signal
import time

import psutil
import pytest

from rl.manifest import stable_info
from rl.orchestrator.sampler import TaskSampler
from rl.orchestrator.state import load_state
from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, rl_command, wait_gone

pytestmark = pytest.mark.integration
MAX_STEPS = 100
STOP_WITHIN_S = 30
CHILD_WAIT_S = 120  # a restarted role's own children (an env server's workers) start within this
ENDS_THE_RUN = ("orchestrator", "trainer rank", "inference API", "engine core")
VICTIMS = (*ENDS_THE_RUN, "env server", "env worker")
TRAINER_STEP = re.compile(r"rl: step (\d+) trainer ")


def current_step(run: Launched) -> int:
    """The newest step this launch's trainer finished (-1 before its first): a resumed run's own."""
    steps = [int(m.group(1)) for line in run.lines if (m := TRAINER_STEP.match(line))]
    return max(steps, default=-1)


def wait_for_step(run: Launched, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while current_step(run) < step:
        assert run.proc.poll() is None, f"rl ended before step {step}:\n{run.output[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s} s:\n{run.output[-4000:]}"
        time.sleep(0.2)


def victim_pid(run: Launched, victim: str) -> int:
    """The process to kill: a launcher child by the name it reported, or one of that child's own children."""
    def children(name: str, match) -> list[psutil.Process]:
        """Waited for: a child the launcher restarted a moment ago (the env server killed two steps before, as
        RL_FAULT_SEED=556124005 drew) starts its own children only once it has loaded, while the run goes on with
        the groups already finished."""
        deadline = time.monotonic() + CHILD_WAIT_S
        while True:
            try:  # the pid reported last may be the killed one until the launcher reports its restart
                found = [p for p in psutil.Process(run.child_pid(name)).children(recursive=True) if match(p)]
            except psutil.NoSuchProcess:
                found = []
            if found:
                return found
            assert time.monotonic() < deadline, f"no process for {victim} under {name} within {CHILD_WAIT_S} s"
            time.sleep(0.2)

    def cmdline(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""

    if victim == "orchestrator":
        return run.child_pid("orchestrator")
    if victim == "trainer rank":
        return children("trainer", lambda p: "rl.trainer" in cmdline(p) and "torchrun" not in cmdline(p))[-1].pid
    if victim == "inference API":
        return run.child_pid("inference")
    if victim == "engine core":
        return children("inference", lambda p: "EngineCore" in cmdline(p) or "EngineCore" in p.name())[0].pid
    if victim == "env server":
        return run.child_pid("env-reverse-text")
    return children("env-reverse-text", lambda p: True)[0].pid  # an env worker


def trained_groups(paths: RunPaths) -> list[tuple[str, int]]:
    """Each step's groups as its batch's marker lists them."""
    groups = []
    for step in range(MAX_STEPS):
        groups += [(env, task) for env, task, _ in stable_info(paths.rollouts(step))["groups"]]
    return groups


@pytest.mark.timeout(2400)
def test_every_role_killed_once_and_every_drawn_task_trained_once(tiny_model, tmp_path):
    seed = int(os.environ.get("RL_FAULT_SEED", random.randrange(1 << 30)))
    print(f"RL_FAULT_SEED={seed}")
    rng = random.Random(seed)
    victims = list(VICTIMS)
    rng.shuffle(victims)
    moments = sorted(rng.sample(range(8, MAX_STEPS - 8, 3), len(victims)))  # steps spread over the run
    out, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    extra = ["--ckpt.interval", "3", "--orchestrator.dispatch", "continuous",
             "--trainer.keep-rollouts", str(MAX_STEPS)]  # every batch's marker stays, to be read back
    run, resumes = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra)), 0
    for victim, step in zip(victims, moments):
        wait_for_step(run, step)
        time.sleep(rng.uniform(0, 1))
        processes = run.descendants()
        os.kill(victim_pid(run, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        print(f"killed {victim} at step {current_step(run)}")
        if victim not in ENDS_THE_RUN:
            continue  # the launcher starts the env server again; the run goes on
        code = run.wait(timeout=STOP_WITHIN_S + 30)
        assert code != 0 and time.monotonic() - killed_at < STOP_WITHIN_S, (victim, code, run.output[-3000:])
        left = wait_gone(processes, STOP_WITHIN_S - (time.monotonic() - killed_at))
        assert not left, f"after {victim} was killed, still running: {left}"
        run, resumes = Launched(rl_command(tiny_model, out, MAX_STEPS, *extra, "--resume")), resumes + 1
    assert run.wait(timeout=1200) == 0, run.output[-5000:]
    assert resumes == len(ENDS_THE_RUN)

    metrics = read_metrics(paths)
    for process in ("trainer", "orchestrator"):
        steps = [m["step"] for m in metrics if m["process"] == process]
        assert steps == list(range(MAX_STEPS)), f"{process} logged steps {steps}"
    final = load_state(paths, MAX_STEPS)
    (sampler,) = final["samplers"]
    draws = TaskSampler(sampler["num_tasks"], sampler["seed"]).draw(sampler["epoch"] * sampler["num_tasks"]
                                                                   + sampler["offset"])
    handled = collections.Counter(task for _, task in trained_groups(paths))
    handled.update(task for _, task in final["pending"])
    drawn = collections.Counter(draws)
    assert handled == drawn, (f"trained more than drawn: {dict(handled - drawn)}; drawn, never trained: "
                              f"{dict(drawn - handled)}")
    assert max(handled.values()) == 1  # one epoch of 2,000 tasks: each drawn once
