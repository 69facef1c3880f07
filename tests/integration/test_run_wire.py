"""The whole loop with weights over the wire (`--transfer.backend gloo`): torchrun trainer (2 ranks), orchestrator,
two vLLM servers; every step is broadcast from trainer rank 0 into both servers, no weights file written but the
final checkpoint's. LoRA adapters over the wire, into a tensor-parallel server: test_run_lora.py; faults:
test_faults_wire.py."""

import re

import pytest
import torch

from rl.inference.fingerprint import checkpoint_fingerprint
from rl.protocol import RunPaths, read_metrics, stable_steps
from tests.integration.launched import Launched, rl_command

pytestmark = pytest.mark.integration

ALTERED = "model.layers.0.mlp.down_proj.weight"


def test_four_steps_over_the_wire_to_two_servers_one_refusing_an_altered_step(tiny_model, tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "corrupt_receive").write_text(ALTERED)  # one server (whichever receives first) gets step 1 altered
    monkeypatch.setenv("RL_TEST_HOOK_DIR", str(hooks))
    out = tmp_path / "run"
    run = Launched(rl_command(tiny_model, out, 4, "--inference-replicas", "2", "--transfer.backend", "gloo"))
    code = run.wait(timeout=900)
    assert code == 0, run.output[-5000:]
    paths = RunPaths(out)
    metrics = read_metrics(paths)
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}
    assert sorted(trainer) == [0, 1, 2, 3]
    assert all(trainer[k]["weights_sent"] for k in trainer), trainer
    sent = {k + 1: trainer[k]["weights_checksum"] for k in trainer}  # step k trains v_k into v_{k+1}
    assert len(set(sent.values())) == 4

    log = (out / "logs" / "orchestrator.log").read_text()
    # the altered step was refused by the server that got it, before anything was loaded, and named
    refusals = re.findall(r"policy (\d+) did not reach server (\d): (.*)", log)
    assert len(refusals) == 1 and refusals[0][0] == "1", refusals
    assert "arrived altered" in refusals[0][2] and "still serving step 0" in refusals[0][2]
    # every transfer: the servers that took it report exactly the trainer's checksum of that step
    taken = re.findall(r"policy (\d+) went over the wire to (\d) of 2 servers \(checksums \[(.*?)\]\); "
                       r"they serve policies \[(\d+), (\d+)\]", log)
    assert [int(step) for step, *_ in taken] == [1, 2, 3, 4], taken
    for step, count, checksums, *serving in taken:
        assert re.findall(r"'([0-9a-f]+)'", checksums) == [sent[int(step)]] * int(count)
    assert taken[0][1] == "1" and sorted(taken[0][3:]) == ["0", "1"]  # the refusing server kept step 0
    assert taken[1][1:] == ("2", taken[1][2], "2", "2")  # and the next offer brought it up to date
    assert taken[-1][3:] == ("4", "4")

    # no files but what a resume needs (the final checkpoint), and the same checksum for its files
    assert stable_steps(paths.weights_root) == [4]
    assert checkpoint_fingerprint(paths.weights(4), torch.float32, tied=True)[1] == sent[4]
    logs = {name: (out / "logs" / name).read_text() for name in ("trainer.log", "inference-0.log", "inference-1.log")}
    assert "arrived altered" in logs["inference-0.log"] + logs["inference-1.log"]
    # one group of trainer rank 0 and both servers carried every step: formed at the first, kept after (the refusal
    # of the altered step came after the transfer itself went through)
    assert all(log.count("formed the transfer group") == 1 for log in logs.values()), logs["trainer.log"][-3000:]

