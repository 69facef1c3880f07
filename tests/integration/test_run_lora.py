"""A LoRA run for real: `rl` with trainer.lora, the trainer publishing adapters, the vLLM server (tensor-parallel:
two workers) loading each in place and verifying it, the orchestrator sampling from the adapter; then
`eval --adapter` on the last one, on a tensor-parallel server eval starts itself."""

import json

import pytest

from rl.manifest import STABLE
from rl.protocol import RunPaths, read_metrics
from tests.integration.launched import Launched, free_port, rl_command

pytestmark = pytest.mark.integration


def test_a_lora_run_serves_the_adapters_the_trainer_published(tiny_model, tmp_path):
    out = tmp_path / "run"
    run = Launched(rl_command(tiny_model, out, 3, "--trainer.lora.rank", "8", "--trainer.optim.lr", "5e-3",
                              "--inference.tensor-parallel-size", "2"))
    assert run.wait(timeout=900) == 0, run.output[-5000:]
    paths = RunPaths(out)
    metrics = read_metrics(paths)
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}
    orchestrator = {m["step"]: m for m in metrics if m["process"] == "orchestrator"}
    assert sorted(trainer) == sorted(orchestrator) == [0, 1, 2]
    # the trainer's checksum of every adapter it published: in the step's marker, and for steps >= 1 in the
    # metrics of the step that made it
    marked = {k: json.loads((paths.weights(k) / STABLE).read_text())["adapter_checksum"] for k in range(4)}
    assert all(trainer[k]["adapter_checksum"] == marked[k + 1] for k in trainer)
    assert len(set(marked.values())) == 4  # every step changed the adapter
    # every load the orchestrator made (the step-0 adapter before batch 0, then newer steps) was served with the
    # trainer's checksum: the server computes it from what it read and verified served
    loads = {m["policy_step"]: m["served_checksums"] for m in orchestrator.values() if "served_checksums" in m}
    assert 0 in loads and len(loads) >= 2, orchestrator
    for policy, checksums in loads.items():
        assert checksums == [marked[policy]], (policy, checksums, marked)
    assert "LoRA on 28 layers" in (out / "logs" / "trainer.log").read_text()  # 7 projections x 4 layers

    # eval of the last adapter over its base model, through a server eval starts and verifies
    results = tmp_path / "eval"
    cmd = ["-m", "rl.eval.main", "--model.name", str(tiny_model), "--adapter", str(paths.weights(3)),
           "--output-dir", str(results), "--num-examples", "4", "--rollouts-per-example", "1",
           "--inference.port", str(free_port()), "--inference.tensor-parallel-size", "2"]
    evaluation = Launched([run.proc.args[0], *cmd])
    assert evaluation.wait(timeout=600) == 0, evaluation.output[-5000:]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["adapter"] == str(paths.weights(3)) and summary["envs"]["reverse-text"]["rollouts"] == 4
    assert marked[3] in (results / "logs" / "inference.log").read_text() + evaluation.output
