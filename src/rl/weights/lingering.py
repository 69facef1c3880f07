"""Threads a deadline left behind inside C++ (a transfer group forming, a store connecting), and a clean exit past them.

Such a thread cannot be stopped: gloo holds it until its own timeout (about five times what it was given). If the
process exits meanwhile, C++'s teardown runs under it and aborts the process ("terminate called without an active
exception", status 134), which reads as a crash and hides the process's own status. So at exit such threads get
`EXIT_WAIT_S` to end; past that the process leaves without the C++ teardown (`os._exit`), its logs and streams
flushed, with the status its Python exit would have had: 1 after an uncaught exception, else 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

EXIT_WAIT_S = 2.0
_left: list[threading.Thread] = []
_lock = threading.Lock()


def leave_behind(thread: threading.Thread) -> None:
    """`thread` (a daemon) outlived its caller's deadline: the process's exit must not run C++'s teardown under it."""
    with _lock:
        if not _left:
            atexit.register(_exit_past_lingering)
        _left.append(thread)


def still_running() -> list[threading.Thread]:
    with _lock:
        _left[:] = [t for t in _left if t.is_alive()]
        return list(_left)


def _exit_past_lingering() -> None:
    for thread in still_running():
        thread.join(EXIT_WAIT_S)
    lingering = still_running()
    if not lingering:
        return
    status = 1 if getattr(sys, "last_value", None) is not None else 0  # set by an uncaught exception's report
    names = ", ".join(t.name for t in lingering)
    print(f"rl: exiting (status {status}) while threads still wait in C++ past their deadline ({names}): without "
          "C++'s teardown, which would abort under them", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(status)
