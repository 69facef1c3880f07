"""What every rl process sets up first thing in its main(): an exit without the interpreter's final garbage
collections, and its threads' stacks on request.

At exit CPython collects garbage once more over every object still alive; with torch, vLLM or verifiers imported
that walk took 4-5 s of CPU per process (measured on the launcher after its environment check: 4.5 s, 0.3 s
frozen), and every process of a run pays it at once when the run ends. Frozen objects are skipped by the collector;
everything else at exit happens as before: the other exit handlers run first (this one is registered first, so runs
last: logging's flush among them), and objects freed by reference counting are finalized as usual.

`kill -USR1 <pid>` has the process write every thread's Python stack to its stderr (its log, under `rl`) and go on:
where a process that does not finish is waiting, without a debugger (the tests send it to a run that overstays)."""

import atexit
import faulthandler
import gc
import signal
import sys

STACKS_SIGNAL = signal.SIGUSR1


def set_up_process() -> None:
    """Call first thing in a process's main()."""
    atexit.register(gc.freeze)
    # The process's own stderr (descriptor 2), which a caller may have replaced with an object that has no
    # descriptor (pytest's capture, when a test calls a main()); a process without one writes no stacks.
    if sys.__stderr__ is not None:
        faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
