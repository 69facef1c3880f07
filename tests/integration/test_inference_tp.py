"""Tensor-parallel inference on the tiny model: a TP=2 server (one core per worker) serves what a TP=1 server serves,
before and after an update; every worker proves its own shard, so a wrong row on one worker's slice of a
column-parallel, row-parallel or vocab-parallel tensor is refused and rolled back; a reload failed on purpose at any
point rolls back for certain; and what the server checked is what it loads (a step directory swapped after its
check, a weight file cut short inside its data). Faults are driven by rl's test hooks (rl/inference/hooks.py)."""

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from rl.weights.config import CollectiveTransfer
from rl.trainer.transfer import collective_sender
from rl.weights.digest import TensorDigest
from rl.weights.offers import offered_steps, read_offer, write_take
from rl.inference.fingerprint import checkpoint_fingerprint
from tests.integration.inference_server import Server, model_and_weights_dir
from tests.integration.test_inference import PROMPTS, TOLERANCE, perturbed_step
from tests.unit.test_transfer import SECRET, single_rank_world

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = model_and_weights_dir(tmp_path_factory, "inference-tp")
    (root / "hooks").mkdir()
    return root


@pytest.fixture(scope="module")
def servers(run_dir):
    """A TP=1 and a TP=2 server on the same model and weights dir, started side by side."""
    started: dict[int, Server] = {}

    def start(tp: int):  # the TP=2 server takes steps over the wire too, whole or as changes
        wire = f'[transfer]\nbackend = "gloo"\nsparse = true\nsecret = "{SECRET}"\n' if tp == 2 else ""
        started[tp] = Server(run_dir / "model", run_dir / "weights", run_dir / f"inference-tp{tp}.log",
                             toml=f"tensor_parallel_size = {tp}\n{wire}",
                             env={"RL_TEST_HOOK_DIR": str(run_dir / "hooks")})

    threads = [threading.Thread(target=start, args=(tp,)) for tp in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert set(started) == {1, 2}, "a server did not start: see inference-tp*.log"
        yield started[1], started[2]
    finally:
        for server in started.values():
            server.stop()


def update(server, step: int, path: str | None = None) -> httpx.Response:
    return server.admin("POST", "/update_weights", json={"step": step, "path": path or f"step_{step}"})


def greedy(server) -> list[tuple[list[int], list[float]]]:
    return [server.generate(prompt, max_tokens=12, temperature=0.0) for prompt in PROMPTS]


def assert_same_outputs(a, b) -> None:
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(a, b, strict=True):
        assert tokens_a == tokens_b
        assert max(abs(x - y) for x, y in zip(logprobs_a, logprobs_b, strict=True)) < TOLERANCE


def files_checksum(directory: Path) -> str:
    return checkpoint_fingerprint(directory, torch.float32, tied=True)[1]


def arm(run_dir, hook: str, value: str = "") -> None:
    (run_dir / "hooks" / hook).write_text(value)


def test_tp2_serves_what_tp1_serves_before_and_after_an_update(servers, run_dir):
    tp1, tp2 = servers
    base = greedy(tp2)
    assert_same_outputs(greedy(tp1), base)
    step = perturbed_step(run_dir, 1, seed=1)
    workers = [p for p in psutil.Process(tp2.proc.pid).children(recursive=True) if "Worker_TP" in p.name()]
    assert len(workers) == 2, [p.name() for p in workers]
    # forked workers run on the cores vLLM chose for them (test_inference.py has the case of one worker)
    chosen = {f"VLLM::Worker_TP{rank}": {int(core)}
              for rank, core in re.findall(r"local_rank=(\d), core ids=\[(\d+)\]", tp2.log.read_text())}
    assert len(chosen) == 2 and chosen["VLLM::Worker_TP0"] != chosen["VLLM::Worker_TP1"], chosen
    assert {p.name(): os.sched_getaffinity(p.pid) for p in workers} == chosen
    before_reads = [p.io_counters().read_chars for p in workers]
    answers = [update(server, 1) for server in servers]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["weights_checksum"] == answers[1].json()["weights_checksum"] == files_checksum(step)
    # the server read the weight file once for both workers, which map its bytes and read none themselves
    file_bytes = (step / "model.safetensors").stat().st_size
    assert answers[1].json()["bytes_read"] == file_bytes
    worker_reads = [p.io_counters().read_chars - b for p, b in zip(workers, before_reads, strict=True)]
    print(f"TP=2 update of a {file_bytes}-byte step: bytes read by each worker {worker_reads}")
    assert all(read < file_bytes // 100 for read in worker_reads), worker_reads
    # each worker moved its shard to its device, not the whole step (all but the norms are split in two here)
    moved = [a.json()["device_bytes"] for a in answers]
    print(f"bytes moved to the device by the busiest worker: TP=1 {moved[0]}, TP=2 {moved[1]}")
    assert moved[0] > 0.95 * file_bytes and moved[1] < 0.55 * moved[0], moved
    after = greedy(tp2)
    assert_same_outputs(greedy(tp1), after)
    assert after != base  # the update changed what is served


# One row of one worker's shard, changed in the load after its fingerprint was taken (worker 1 holds rows
# 64..127 of q_proj's 128 rows, columns 64..127 of o_proj's input, vocabulary rows 64..106 of the head; k_proj's
# 2 heads are split, one per worker). The embedding's case is a step without lm_head.weight: the tied head is fed
# from the embedding's bytes, which would otherwise overwrite the changed row.
WRONG_SHARDS = [
    ("column-parallel", "model.layers.1.self_attn.q_proj.weight", 100, 1, 2),
    ("row-parallel", "model.layers.1.self_attn.o_proj.weight", 3, 1, 2),
    ("kv-heads", "model.layers.2.self_attn.k_proj.weight", 40, 1, 2),
    ("vocab-parallel head", "lm_head.weight", 90, 1, 2),
    ("vocab-parallel embedding", "model.embed_tokens.weight", 70, 1, 7),
]


@pytest.mark.parametrize("tensor, row, rank, step", [w[1:] for w in WRONG_SHARDS], ids=[w[0] for w in WRONG_SHARDS])
def test_a_wrong_row_on_one_workers_shard_is_refused_naming_it_and_the_old_weights_serve(servers, run_dir, tensor,
                                                                                         row, rank, step):
    _, tp2 = servers
    if not (run_dir / "weights" / f"step_{step}").exists():
        perturbed_step(run_dir, step, seed=step, drop="lm_head.weight" if "embed" in tensor else None)
    served, before = tp2.admin("GET", "/policy_step").json(), greedy(tp2)
    arm(run_dir, "corrupt_reload", f"{tensor} {row} {rank}")
    answer = update(tp2, step)
    assert answer.status_code == 500, answer.text
    detail = answer.json()["detail"]
    assert f"worker {rank}: {tensor}: exact part differs" in detail, detail
    assert f"worker {1 - rank}: " not in detail, detail  # the other worker's shard verified
    assert f"rolled back to step {served['step']}, which verifies" in detail
    assert tp2.admin("GET", "/policy_step").json() == served
    assert greedy(tp2) == before


@pytest.mark.parametrize("fail_at", [0, 23, 46])
def test_a_reload_failing_at_any_point_rolls_back_to_verified_weights(servers, run_dir, fail_at):
    """vLLM moves each layer to the meta device as a reload begins: one stopped halfway must still roll back."""
    step = run_dir / "weights" / "step_3"
    if not step.exists():
        perturbed_step(run_dir, 3, seed=3)
    for server in servers:
        served, before = server.admin("GET", "/policy_step").json(), greedy(server)
        arm(run_dir, "fail_reload_at", str(fail_at))
        answer = update(server, 3)
        assert answer.status_code == 500 and "failed on purpose" in answer.text, answer.text
        assert "which verifies" in answer.text, answer.text
        assert server.admin("GET", "/policy_step").json() == served
        assert greedy(server) == before


def test_the_step_directory_swapped_for_a_link_after_its_check_is_not_what_loads(servers, run_dir, tmp_path):
    """The rename-exchange race: the update holds (a test hook) after reading STABLE, the directory is swapped for
    a link to another step outside the weights dir (same file names and sizes, other weights), then released.
    Every read goes through the handle opened for the check, in the server and in every worker, so the checked
    step loads and nothing outside is read."""
    outside = tmp_path / "outside"
    shutil.copytree(run_dir / "model", outside / "model")
    (outside / "weights").mkdir()
    for server, step in zip(servers, (4, 5), strict=True):
        checked = perturbed_step(run_dir, step, seed=step)
        elsewhere = perturbed_step(outside, step, seed=100 + step)
        expected = files_checksum(checked)
        assert expected != files_checksum(elsewhere)
        arm(run_dir, "after_check")
        reply: dict = {}
        waiter = threading.Thread(target=lambda: reply.update(answer=update(server, step)))  # noqa: B023
        waiter.start()
        wait_for(run_dir / "hooks" / "after_check.held")
        os.rename(checked, run_dir / "weights" / f"checked_{step}")
        (run_dir / "weights" / f"step_{step}").symlink_to(elsewhere, target_is_directory=True)
        (run_dir / "hooks" / "after_check.held").unlink()
        (run_dir / "hooks" / "after_check").unlink()
        waiter.join(120)
        answer = reply["answer"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["weights_checksum"] == expected
        (run_dir / "weights" / f"step_{step}").unlink()
        os.rename(run_dir / "weights" / f"checked_{step}", checked)


def wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def test_a_weight_file_cut_short_inside_its_data_is_422_and_nothing_loads(servers, run_dir):
    _, tp2 = servers
    step = perturbed_step(run_dir, 6, seed=6)
    weights = step / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 4096])
    from rl.protocol import mark_stable

    mark_stable(step)  # the marker agrees with the short file: only its header says the data is longer
    served, before = tp2.admin("GET", "/policy_step").json(), greedy(tp2)
    answer = update(tp2, 6)
    assert answer.status_code == 422 and "past its end" in answer.text, answer.text
    assert tp2.admin("GET", "/policy_step").json() == served
    assert greedy(tp2) == before


def test_a_step_the_first_worker_receives_loads_on_both_workers_and_one_altered_on_the_way_is_refused(servers,
                                                                                                     run_dir):
    """NCCL's path, proved on CPU with gloo in its place (the `receive_in_worker` hook): the server's first worker
    forms its group with generation held (once: later steps keep it) and receives the step while generation goes on,
    the server takes its sealed memfd over, and both workers load and verify it; a step altered on the way is refused
    before anything loads. Then sparse_nccl's: the next step comes as its changes, which the first worker applies to
    the bytes the server serves."""
    tp1, tp2 = servers
    step_dir = perturbed_step(run_dir, 20, seed=20)  # steps 20 to 22: no other test of this module's
    tensors = list(load_file(step_dir / "model.safetensors").items())
    config = CollectiveTransfer(backend="gloo", sparse=True, secret=SECRET, timeout_s=30, offer_timeout_s=60)
    sender = collective_sender(config, run_dir / "wire", single_rank_world(), torch.float32, first_step=0)
    try:
        served, before = tp2.admin("GET", "/policy_step").json(), greedy(tp2)
        arm(run_dir, "receive_in_worker")
        arm(run_dir, "corrupt_receive", "model.layers.0.mlp.up_proj.weight")
        answer, sent = send_over_the_wire(tp2, sender, run_dir / "wire", 20, tensors)
        assert answer.status_code == 422 and "arrived altered" in answer.text, answer.text
        assert tp2.admin("GET", "/policy_step").json() == served
        assert greedy(tp2) == before

        arm(run_dir, "receive_in_worker")
        answer, sent = send_over_the_wire(tp2, sender, run_dir / "wire", 21, tensors)
        assert answer.status_code == 200, answer.text
        assert answer.json()["weights_checksum"] == sent["weights_checksum"] == files_checksum(step_dir)
        assert sent["transfer_sparse"] is False  # the server refused step 20: it serves other weights
        assert update(tp1, 20).status_code == 200
        assert_same_outputs(greedy(tp1), greedy(tp2))
        log = (run_dir / "inference-tp2.log").read_text()
        pid = int(re.search(r"step 21 received over gloo by the first worker \(pid (\d+)\)", log)[1])
        assert "Worker_TP0" in psutil.Process(pid).name()

        changed = [(name, tensor.clone()) for name, tensor in tensors]
        for name, tensor in changed:
            if name.endswith("mlp.down_proj.weight"):
                tensor[0, :4] += 0.5
        arm(run_dir, "receive_in_worker")
        answer, sent = send_over_the_wire(tp2, sender, run_dir / "wire", 22, changed)
        assert answer.status_code == 200, answer.text
        assert sent["transfer_sparse"] is True and sent["transfer_bytes"] == 4 * 4 * (4 + 4)  # 4 layers' 4 elements
        digest = TensorDigest()
        for name, tensor in changed:
            digest.update(name, tensor)
        assert answer.json()["weights_checksum"] == sent["weights_checksum"] == digest.hexdigest()
        assert len(greedy(tp2)) == len(before)  # and it serves them
        # the worker's group formed once, at step 20, with generation held for it; 21 and 22 came over the kept one
        log = (run_dir / "inference-tp2.log").read_text()
        assert re.findall(r"step (\d+): generation held [\d.]+ s while the transfer group formed", log) == ["20"]
    finally:
        sender.close()


def send_over_the_wire(server, sender, wire_dir: Path, step: int, tensors) -> tuple[httpx.Response, dict]:
    """The trainer's sender offers `step` (in a thread), the test takes it for `server` alone as the orchestrator
    would; the server's answer and the sender's stats."""
    sent: dict = {}
    thread = threading.Thread(target=lambda: sent.update(sender.send_tensors(step, tensors)))
    thread.start()
    answer = take_for(server, wire_dir, step)
    thread.join(60)
    assert not thread.is_alive(), "the sender hung"
    return answer, sent


def take_for(server, wire_dir: Path, step: int, timeout_s: float = 30) -> httpx.Response:
    """The orchestrator's part of a step over the wire: wait for the trainer's offer of `step`, take it for `server`
    alone, and ask the server to receive it; the server's answer."""
    wait_for(wire_dir / "transfer" / f"offer_{step}.json")
    assert step in offered_steps(wire_dir)
    offer = read_offer(wire_dir, step)
    write_take(wire_dir, step, 1)
    spec = {"host": offer.host, "port": offer.port, "rank": 1, "world_size": 2, "timeout_s": timeout_s}
    return server.admin("POST", "/update_weights", json={"step": step, "transfer": spec})
