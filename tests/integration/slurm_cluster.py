"""A one-host SLURM cluster for tests: munged, slurmctld and slurmd started from a temporary directory with a
config of their own (Debian's slurm-wlm and munge; .ci/run installs them). Nothing outside that directory is
configured or started, and every daemon is stopped at the end."""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from tests.integration.launched import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


def slurm_available() -> bool:
    return os.geteuid() == 0 and all(shutil.which(d) for d in DAEMONS)


class SlurmCluster:
    def __init__(self, root: Path, startup_timeout_s: float = 60):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.socket = root / "munge.socket"
        self.conf = root / "slurm.conf"
        self.env = os.environ | {"SLURM_CONF": str(self.conf)}
        for sub in ("state", "spool"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True, env=self.env, capture_output=True, timeout=30)
        self._wait_idle(startup_timeout_s)

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            ["munged", "--force", f"--key-file={key}", f"--socket={self.socket}", f"--pid-file={self.root}/munged.pid",
             f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munged.seed"],
            check=True, capture_output=True, timeout=30,
        )

    def _write_conf(self) -> None:
        memory_mb = psutil.virtual_memory().total // 2**20 - 1024
        self.conf.write_text(f"""ClusterName=rltest
SlurmctldHost={self.node}
SlurmUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.socket}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={self.node} CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            state = done.stdout.strip() or done.stderr.strip()
            if state == "idle":
                return
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"the SLURM node was not idle after {timeout_s:.0f}s (sinfo: {state!r}); "
                           f"logs in {self.root}")

    def job_state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) of a job, as scontrol reports it."""
        done = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True)
        fields = dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")

    def wait_job(self, job: str, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(2)
        subprocess.run(["scancel", job], env=self.env, capture_output=True)
        raise TimeoutError(f"SLURM job {job} still {self.job_state(job)} after {timeout_s:.0f}s")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
