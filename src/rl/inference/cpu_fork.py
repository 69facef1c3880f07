"""What a vLLM process forked from a CPU server's API process does first (`rl.patches.vllm_cpu_fork` forks them): what
every forked child of rl's does (rl/process.py), then the cores and threads vLLM's environment names for it, as a
spawned one would take them. Called in the child by an at-fork hook, before any other code of it runs."""

from __future__ import annotations

import os
import re
import sys

from rl.process import cut_from_parent


def child() -> None:
    """Run in each process forked from a CPU server's API process (vLLM's engine core, then its workers)."""
    cut_from_parent()
    bind_threads_from_environment()


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
