"""The whole loop for real: vLLM server (tensor-parallel: two workers), orchestrator with verifiers environments,
each in an env server `rl` starts, torchrun trainer. The environments are a user's own Taskset-only package
(tests/fixtures/environments, put on PYTHONPATH as an installed package would be) mixed with reverse-text (its
server with 2 workers), with a periodic eval. Each process killed
mid-run, `--resume` and `--resume-step` after it, are in test_faults.py; the `eval` command in
test_environments.py."""

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from rl.inference.fingerprint import checkpoint_fingerprint
from rl.protocol import RunPaths, read_batch, read_metrics, stable_steps
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration
MIXED = """
[[env]]
id = "taskset-only"
ratio = 3.0
[[env]]
id = "reverse-text"
args = { num_examples = 200 }
ratio = 1.0
workers = 2

[eval]
interval = 3
num_examples = 2
rollouts_per_example = 2
sampling = { temperature = 1.0, max_tokens = 8 }
[[eval.env]]
id = "taskset-only"
"""


def test_five_steps_end_to_end_of_a_taskset_only_environment_mixed_with_reverse_text(tiny_model, tmp_path,
                                                                                     taskset_only_installed):
    mixed = tmp_path / "mixed.toml"
    mixed.write_text(MIXED)
    out = tmp_path / "run"
    run = Launched(rl_command(tiny_model, out, 5, "--inference.tensor-parallel-size", "2",
                              "--orchestrator", "@", str(mixed), "--orchestrator.max-off-policy-steps", "2"))
    code = run.wait(timeout=900)
    assert code == 0, run.output[-5000:]
    paths = RunPaths(out)
    metrics = read_metrics(paths)
    check_environments_mixed(out, [m for m in metrics if m["process"] == "orchestrator"])
    check_report(out, run.output)
    for process in ("trainer", "orchestrator"):
        steps = [m["step"] for m in metrics if m["process"] == process]
        assert steps == [0, 1, 2, 3, 4], f"{process} logged steps {steps}"
    # async_level=1: batch k needs a policy >= k - 1 (and none newer than k exists yet), so inference
    # is moved forward step by step; each update fails unless the server reports the requested step.
    served = [m["policy_step"] for m in metrics if m["process"] == "orchestrator"]
    assert all(k - 1 <= v <= k for k, v in enumerate(served)), served
    assert served == sorted(served) and served[-1] >= 3, served
    # continuous dispatch (the default): no trained token older than max_off_policy_steps (2 here)
    assert all(m["staleness"] <= 2 and m["off_policy/max"] <= 2 for m in metrics if m["process"] == "orchestrator")
    # every load served exactly the published files: the checksum both workers computed of what they verified
    # (async_level 1 loads a policy only when a batch needs a newer one: 2 to 5 loads, as fast as the trainer is)
    loads = {m["policy_step"]: m["served_checksums"] for m in metrics if "served_checksums" in m}
    kept = {step: checksums for step, checksums in loads.items() if paths.weights(step).is_dir()}  # step 1: deleted
    assert len(loads) >= 2 and len(kept) >= 1, loads
    for step, checksums in kept.items():
        assert checksums == [checkpoint_fingerprint(paths.weights(step), torch.float32, tied=True)[1]], step
    # weights/step_1 is deleted once no server can need it (keep_weights = 4 newest, no checkpoint at 1)
    assert stable_steps(paths.weights_root) == [2, 3, 4, 5]
    assert stable_steps(paths.rollouts_root) == [3, 4]  # keep_rollouts = 2 newest trained batches
    for step in (3, 4):  # whole groups (8 samples of one prompt), none twice: at most the step's 32
        samples = read_batch(paths, step, 0) + read_batch(paths, step, 1)
        prompts = [tuple(s.input_ids[:s.loss_mask.index(1)]) for s in samples]
        assert len(samples) <= 32 and all(prompts.count(p) % 8 == 0 for p in prompts), step

    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(paths.weights(5))
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [n for n, p in final.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed, "published weights equal the base model"
    files = load_file(str(paths.weights(5) / "model.safetensors"))
    assert torch.equal(files["lm_head.weight"], files["model.embed_tokens.weight"])  # written explicitly
    assert (out / "configs" / "trainer.toml").is_file()
    assert "step 4 trainer" in run.output  # the launcher's one line per step
    started = dict(re.findall(r"rl: started (\S+) \(pid \d+\), log \S+(.*)", run.output))
    forked = {name for name, how in started.items() if how == " (forked from the launcher)"}
    # the orchestrator (files carry its weights: the launcher holds no transfer secret), not inference nor the trainer,
    # nor the env servers (training and eval), which must not start with the admin token the launcher holds
    from rl.launcher.main import ORCHESTRATOR_SECRETS
    from rl.launcher.supervisor import is_secret

    clean = not any(is_secret(name) and name not in ORCHESTRATOR_SECRETS for name in os.environ)
    assert forked == ({"orchestrator"} if clean else set()), started
    assert len(set(started) - {"inference", "trainer"}) == 4, started


def check_environments_mixed(out, records: list[dict]) -> None:
    """The user's Taskset-only environment loaded with rl's default harness, each step's rollouts split by the
    environments' ratios, each environment's rewards and metrics logged, and the eval's after its interval and at
    the end; the episodes of each run by the env server `rl` started for it, with its workers."""
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "environment 'taskset-only': 64 tasks; seat 'agent': harness 'in-process-chat' (rl's default" in log
    assert "episodes run by ipc://" in log
    for name, workers in (("env-taskset-only", 1), ("env-reverse-text", 2), ("eval-taskset-only", 1)):
        server_log = (out / "logs" / f"{name}.log").read_text()
        assert len(re.findall(r"INFO EnvServer up: taskset=", server_log)) == workers, server_log[-2000:]
    assert [m["step"] for m in records] == [0, 1, 2, 3, 4]
    for m in records:
        # 32 rollouts a step in groups of 8: 3 groups of taskset-only for 1 of reverse-text
        assert (m["rollouts/taskset-only"], m["rollouts/reverse-text"]) == (24, 8), m
        assert 0.0 <= m["metric/taskset-only/exact"] <= 1.0 and m["metric/taskset-only/reply_chars"] > 0
        assert "reward/taskset-only/similarity" in m and "metric/reverse-text/exact_match" in m
    assert all(m["orchestrator/cpu_ms_per_rollout"] > 0 for m in records)
    assert (records[-1]["env/taskset-only/workers"], records[-1]["env/reverse-text/workers"]) == (1, 2)  # live
    evaluated = [m["step"] for m in records if "eval/avg@2" in m]
    assert evaluated == [2, 4], evaluated  # every 3 batches, and after the last
    assert {"eval/pass@1/taskset-only", "eval/pass@2/taskset-only", "eval/avg@2"} <= set(records[-1])


def check_report(out, output: str) -> None:
    """Where the run's time went: each step line says the elapsed time and the time left, and the launcher wrote
    report.html (launcher/run_report.py) at the end, with the plots of what this run logs."""
    assert re.search(r"rl: step 1 trainer .* \[\S+ elapsed, ~\S+ left\]", output), output[-3000:]
    assert re.search(r"rl: step 4 trainer .* \[\S+ elapsed, max_steps reached\]", output), output[-3000:]
    assert re.search(r"rl: finished: 5 steps in .* elapsed, max_steps reached", output), output[-3000:]
    assert f"rl: report {out / 'report.html'}" in output
    page = (out / "report.html").read_text()
    plots = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert {"Reward", "Trainer loss", "Tokens per second", "Staleness", "Each side&#x27;s wait",
            "Rollouts in flight"} <= set(plots), plots
    assert "orchestrator eval/reward" in page and "trainer time/wait_for_batch" in page  # the eval at steps 2 and 4
    assert "5 of 5" in page and "none: max_steps reached" in page and "<p>summary.json</p>" in page
    assert "configs/orchestrator.toml" in page and "admin_token = &quot;&lt;hidden&gt;&quot;" in page
    token = re.search(r'admin_token = "([^"]+)"', (out / "configs" / "orchestrator.toml").read_text()).group(1)
    assert token not in page


def test_a_geometric_mask_against_rescored_logprobs_keeps_stale_samples_that_only_the_policy_moved(tiny_model,
                                                                                                  tmp_path):
    """Served and trained in float32 the engines agree to ~1e-6, so every sample's geometric mean ratio to inference's
    logprobs under the trained weights is within [0.999, 1.001], however many steps ago it was sampled: nothing is
    masked, while the policy moved since sampling (mismatch_kl, to the sampling logprobs, well above float noise)."""
    out = tmp_path / "run"
    mask = '[{"type": "geo_mask", "against": "rescored", "low": 0.999, "high": 1.001}]'
    run = Launched(rl_command(tiny_model, out, 5, "--async-level", "2", "--trainer.loss.mismatch", mask))
    assert run.wait(timeout=600) == 0, run.output[-5000:]
    metrics = read_metrics(RunPaths(out))
    orchestrator = [m for m in metrics if m["process"] == "orchestrator"]
    trainer = [m for m in metrics if m["process"] == "trainer"]
    assert [m["policy_step"] for m in orchestrator] == [0, 1, 2, 3, 4]  # each batch waited for its own policy
    assert sum(m["rescore/samples"] for m in orchestrator) > 0 and max(m["staleness"] for m in orchestrator) >= 1
    assert [m["masked_seq_frac"] for m in trainer] == [0.0] * 5
    assert max(m["mismatch_kl"] for m in trainer) > 1e-4, [m["mismatch_kl"] for m in trainer]
