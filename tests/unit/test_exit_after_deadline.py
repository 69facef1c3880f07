"""A transfer group's forming thread left behind by its deadline does not abort the process at exit
(rl/weights/lingering.py): C++'s teardown under a thread still inside gloo ended in "terminate called without an
active exception" (status 134)."""

import subprocess
import sys
import textwrap

import pytest

FORM_PAST_DEADLINE = """
from datetime import timedelta
import torch.distributed as dist
from rl.weights import TransferError
from rl.weights.group import Deadline, open_group
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
try:
    open_group(store, 1, 0, 2, Deadline(1.0, 1), "gloo", "run:1")  # rank 1 never comes
except TransferError as e:
    print("refused:", e, flush=True)
"""


def run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("ending, status", [("", 0), ("raise SystemExit(0)", 0), ("raise RuntimeError('late')", 1)])
def test_a_process_exits_with_its_own_status_after_a_group_missed_its_deadline(ending, status):
    done = run(FORM_PAST_DEADLINE + ending)
    assert "refused: the transfer group of step 1 did not form within 1 s" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr and done.returncode == status, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("ending, status", [("", 0), ("raise RuntimeError('late')", 1)])
def test_a_thread_still_lingering_at_exit_is_named_and_the_status_kept(ending, status):
    """Past the exit's short wait, the process leaves without C++'s teardown, saying so, with its status."""
    done = run(f"""
        import threading, time
        from rl.weights.lingering import EXIT_WAIT_S, leave_behind
        thread = threading.Thread(target=time.sleep, args=(60,), name="forming the transfer group of step 3",
                                  daemon=True)
        thread.start()
        leave_behind(thread)
        print("leaving", flush=True)
        {ending}
    """)
    assert done.stdout == "leaving\n" and done.returncode == status, (done.returncode, done.stderr[-2000:])
    assert "while threads still wait in C++ past their deadline (forming the transfer group of step 3)" in done.stderr
