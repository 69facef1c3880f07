"""A LoRA run for real: `rl` with trainer.lora, the trainer sending each step's adapter over the wire (gloo; the
files path of adapters is test_inference_lora's), the vLLM server (tensor-parallel: two workers) loading each in
place and verifying it, the orchestrator sampling from the adapter, and a teacher (a second tiny model, served by
`rl` as the inference server is) scoring every sample for on-policy distillation, with its top 4 tokens at every
trained position for the dense term; then `eval --adapter` on the last
one (the final checkpoint's files), on a tensor-parallel server eval starts itself; then `--resume` for two more
steps on servers of one worker each (a resumed run may lay its servers out anew), the teacher scoring them too."""

import json
import re

import pytest

from rl.manifest import STABLE
from rl.protocol import RunPaths, read_batch, read_metrics, stable_steps
from rl.tiny_model import build_tiny_model
from tests.integration.launched import SMALL_KV_CACHE, Launched, free_port, rl_command

pytestmark = pytest.mark.integration


def test_a_lora_run_serves_the_adapters_the_trainer_sent_and_distils_from_a_teacher(tiny_model, tmp_path):
    out = tmp_path / "run"
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # other weights, the same tokenizer
    flags = ["--trainer.lora.rank", "8", "--trainer.optim.lr", "5e-3", "--transfer.backend", "gloo",
             "--teacher.model", str(teacher), "--trainer.loss.distill", "1.0", "--trainer.keep-rollouts", "3",
             "--teacher.top-k", "4", "--trainer.loss.distill-top-k", "1.0"]
    tensor_parallel = ["--inference.tensor-parallel-size", "2"]  # the teacher's server too
    run = Launched(rl_command(tiny_model, out, 3, *flags, *tensor_parallel, "--teacher.port", str(free_port())))
    assert run.wait(timeout=900) == 0, run.output[-5000:]
    paths = RunPaths(out)
    metrics = read_metrics(paths)
    trainer = {m["step"]: m for m in metrics if m["process"] == "trainer"}
    orchestrator = {m["step"]: m for m in metrics if m["process"] == "orchestrator"}
    assert sorted(trainer) == sorted(orchestrator) == [0, 1, 2]
    assert all(trainer[k]["weights_sent"] for k in trainer)
    # the trainer's checksum of every adapter it sent: the step-0 adapter's in its log, the others in the metrics of
    # the step that made them
    trainer_log = (out / "logs" / "trainer.log").read_text()
    step0 = re.search(r"published the step-0 adapter \(checksum ([0-9a-f]+)\)", trainer_log)
    sent = {0: step0.group(1)} | {k + 1: trainer[k]["adapter_checksum"] for k in trainer}
    assert len(set(sent.values())) == 4  # every step changed the adapter
    # every step went over the wire in order (the step-0 adapter before batch 0), each served (on both workers,
    # from what the server received and verified in vLLM's slots) with the trainer's checksum
    log = (out / "logs" / "orchestrator.log").read_text()
    taken = re.findall(r"policy (\d+) went over the wire to 1 of 1 servers \(checksums \['([0-9a-f]+)'\]\)", log)
    assert [(int(step), checksum) for step, checksum in taken] == sorted(sent.items()), taken
    # the final checkpoint's adapter is the one file step (a resume needs it), with the same checksum
    assert stable_steps(paths.weights_root) == [3]
    assert json.loads((paths.weights(3) / STABLE).read_text())["adapter_checksum"] == sent[3]
    assert "LoRA on 28 layers" in trainer_log  # 7 projections x 4 layers
    # the teacher scored every sample's trained tokens, and the trainer's distillation term saw them
    for step in trainer:
        for rank in (0, 1):
            for sample in read_batch(paths, step, rank):
                scored = [lp for lp, m in zip(sample.teacher_logprobs, sample.loss_mask) if m]
                assert scored and all(lp < 0 for lp in scored)
                for token, lp, ids, top, m in zip(sample.input_ids, sample.teacher_logprobs, sample.teacher_top_ids,
                                                  sample.teacher_top_logprobs, sample.loss_mask):
                    if m:  # 4 distinct tokens, likeliest first; the sampled token among them exactly when it ranks so
                        assert len(set(ids)) == 4 and top == sorted(top, reverse=True) and top[0] <= 0
                        assert (token in ids) == (lp >= top[-1]) or lp == top[-1]
        assert trainer[step]["distill/reverse_kl"] != 0 and orchestrator[step]["teacher_s"] > 0
        assert trainer[step]["distill/top_k_kl"] > 0
    assert f"teacher {str(teacher)!r} at http://127.0.0.1:" in log
    assert (out / "logs" / "teacher.log").exists()

    # eval of the last adapter over its base model, through a server eval starts and verifies
    results = tmp_path / "eval"
    cmd = ["-m", "rl.eval.main", "--model.name", str(tiny_model), "--adapter", str(paths.weights(3)),
           "--output-dir", str(results), "--num-examples", "4", "--rollouts-per-example", "1",
           "--inference.port", str(free_port()), "--inference.tensor-parallel-size", "2", *SMALL_KV_CACHE]
    evaluation = Launched([run.proc.args[0], *cmd])
    assert evaluation.wait(timeout=600) == 0, evaluation.output[-5000:]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["adapter"] == str(paths.weights(3)) and summary["envs"]["reverse-text"]["rollouts"] == 4
    assert sent[3] in (results / "logs" / "inference.log").read_text() + evaluation.output

    # resumed from the final checkpoint for two more steps, on servers of one worker: the teacher served again,
    # every new sample scored, the adapter sent over the wire to the new server
    resumed = Launched(rl_command(tiny_model, out, 5, *flags, "--teacher.port", str(free_port()), "--resume"))
    assert resumed.wait(timeout=900) == 0, resumed.output[-5000:]
    assert "resuming from step 3" in resumed.output
    trainer = {m["step"]: m for m in read_metrics(paths) if m["process"] == "trainer"}
    assert sorted(trainer) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for rank in (0, 1):
            assert all(sample.teacher_logprobs and sample.teacher_top_ids for sample in read_batch(paths, step, rank))
        assert trainer[step]["distill/reverse_kl"] != 0 and trainer[step]["weights_sent"]
