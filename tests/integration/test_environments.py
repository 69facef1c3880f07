"""Environments a user brings, for real: a Taskset-only package (tests/fixtures/environments, put on PYTHONPATH
as an installed package would be) and the `eval` command on the tiny model, starting its own vLLM server or using a
running one (plain vLLM: test_eval_plain_vllm.py). Its training through `rl`, mixed with reverse-text, is
test_run.py's run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.launched import SMALL_KV_CACHE, free_port

pytestmark = pytest.mark.integration


def eval_command(model: Path, out: Path, *extra: str) -> list[str]:
    envs = [{"id": "taskset-only", "name": "echo"}, {"id": "reverse-text", "args": {"num_examples": 50}}]
    return [
        sys.executable, "-m", "rl.eval.main", "--model.name", str(model), "--env", json.dumps(envs),
        "--num-examples", "3", "--rollouts-per-example", "4", "--sampling.temperature", "1.0",
        "--sampling.max-tokens", "8", "--pass-threshold", "0.5", "--output-dir", str(out), *SMALL_KV_CACHE, *extra,
    ]


def check_results(out: Path) -> dict:
    """Every rollout is a line; the summary's scores are those of the lines."""
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 2 * 3 * 4
    for name in ("echo", "reverse-text"):
        mine = [r for r in records if r["env"] == name]
        env = summary["envs"][name]
        assert (env["tasks"], env["rollouts"]) == (3, 12)
        assert env["reward"] == pytest.approx(sum(r["reward"] for r in mine) / 12)
        assert all(r["passed"] == (r["reward"] >= 0.5) for r in mine)
        by_task = [[r for r in mine if r["task_index"] == t] for t in range(3)]
        solved = sum(any(r["passed"] for r in rs) for rs in by_task) / 3
        assert env["pass@4"] == pytest.approx(solved)  # with n = k, pass@k is "any of the n passed"
        assert env["pass@1"] == pytest.approx(sum(r["passed"] for r in mine) / 12)
        assert {"pass@2", "avg@4"} <= set(env)
    assert "metric/exact" in summary["envs"]["echo"] and "reward/lcs_ratio" in summary["envs"]["reverse-text"]
    assert records[0]["prompt"].endswith("assistant\n") and "Repeat:" in records[0]["prompt"]
    return summary


def test_eval_starts_its_own_server_and_writes_results(tiny_model, tmp_path, taskset_only_installed):
    out = tmp_path / "eval"
    done = subprocess.run(eval_command(tiny_model, out, "--inference.port", str(free_port())), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_results(out)
    assert "pass@4" in done.stdout and "echo" in done.stdout  # the table
    assert (out / "logs" / "inference.log").stat().st_size > 0
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"the server outlived eval: {leftover}"
    again = subprocess.run(eval_command(tiny_model, out), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds results.jsonl" in again.stderr
