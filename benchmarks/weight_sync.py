"""Weight publish-to-served latency against its lower bound, and raw vLLM generation throughput.

For each model (the tiny one and a ~100M-parameter one built the same way) this starts the real
inference server and, several times in turn:

- publish: the trainer's `WeightPublisher.publish` (safetensors + config + tokenizer, rename, STABLE), then
  `POST /update_weights` (reload in place + verification), timed end to end;
- lower bound: `safetensors.save_file` of the same tensors alone, plus the server's reload time alone
  (`reload_s`, measured inside the server around vLLM's in-place reload).

- over the wire (`transfer.backend = "gloo"`, rl/weights/): the trainer's `CollectiveSender.send` (offer, take,
  the step's gloo group, every tensor broadcast into the server's memfd, the checksum) with the orchestrator's
  `POST /update_weights {"step", "transfer"}` (receive, check, reload, verify), timed from the offer to the answer;
- its bound: a bare gloo broadcast of the same bytes, in one piece, to another (warm) process receiving into a
  fresh memfd as a server does, plus the server's reload time alone;
- sparse over the wire (`transfer.sparse`, gloo): a step that changes `--changed` of the elements (2%: what peers
  report a bf16 step changes) sent as its changes against the step the server serves, timed as above.

It prints the medians and their ratios (targets: publish-to-served <= 1.5x its bound for files; over the wire
<= 0.5x files and <= 1.3x its bound at ~100M), then the same for a rank-16 LoRA adapter on every projection, on a
server with LoRA on, by files and over the wire, against the full weights' figures, then
the raw generation tokens/s of a fixed request set (64 prompts x 64 tokens, all in flight) on the tiny model. The
last line reads `collective publish-to-served 100M <R>x filesystem, <B>x bound`.

Files are written to a tmpfs (/dev/shm) by default: on this VM's ext4 disk the same 400 MB `save_file`
takes 0.3-1.0 s from one write to the next, which swamps the difference being measured; `--dir` picks
another filesystem (both sides always write to the same one). Before each timed write the files it
replaces are deleted (see `measure_sync`).

Last, over a link limited to 1 Gbit/s (`--link-rate`; tc in network namespaces, as between nodes: needs root, else
skipped saying why), the ~100M model's bf16 steps of AdamW at lr 1e-6 (`--lr`) whole and sparse, side by side in
alternating rounds; the last line then reads `sparse publish-to-served 100M <S>x whole over 1 Gbit/s, collective <B>x
bound` (goals S <= 0.25, B <= 1.3).

    uv run python benchmarks/weight_sync.py [--repeats 5] [--skip-large] [--dir PATH] [--only-link]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl.adapter import (  # noqa: E402
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEFAULT_TARGETS, adapter_checksum, adapter_config_bytes, tensor_name,
)
from rl.weights.config import CollectiveTransfer  # noqa: E402
from rl.protocol import RunPaths  # noqa: E402
from rl.trainer.transfer import CollectiveSender, collective_sender  # noqa: E402
from rl.weights.digest import tensor_bytes  # noqa: E402
from rl.weights.offers import read_offer, write_take  # noqa: E402
from rl.tiny_model import build_tiny_model  # noqa: E402
from rl.trainer.weights import (  # noqa: E402
    DEFAULT_SHARD_BYTES, StepShards, hf_side_files, publish_step, single_process_shards,
)
from tests.integration.inference_server import Server  # noqa: E402
from benchmarks.slow_link import SlowLink, why_no_link  # noqa: E402

SECRET = secrets.token_hex(32)  # the run's transfer.secret, given to the server and the senders alike

MODELS = {
    "tiny": dict(hidden_size=128, layers=4, heads=4, kv_heads=2),
    "100M": dict(hidden_size=768, layers=14, heads=12, kv_heads=4),
}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small update, with the head kept tied to the embedding as the trainer writes it."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items() if k != "lm_head.weight"}
    new["lm_head.weight"] = new["model.embed_tokens.weight"].clone()
    return new


def changed_in_part(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`state` with `fraction` of each tensor's elements changed (the head kept tied), the others bit for bit."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in state.items():
        if k != "lm_head.weight":
            mask = torch.rand(v.shape, generator=g) < fraction
            new[k] = torch.where(mask, v + 1e-3, v)
    new["lm_head.weight"] = new["model.embed_tokens.weight"].clone()
    return new


def measure_sync(root: Path, name: str, repeats: int, changed: float) -> dict:
    model_dir = build_tiny_model(root / name, **MODELS[name])
    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    paths = RunPaths(root / f"run_{name}")
    paths.weights_root.mkdir(parents=True)
    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    side_files = hf_side_files(config, tokenizer)
    base = load_file(str(model_dir / "model.safetensors"))
    server = Server(model_dir, paths.weights_root, root / f"inference_{name}.log", timeout_s=900,
                    toml=f'[transfer]\nbackend = "gloo"\nsparse = true\nsecret = "{SECRET}"\n')  # takes steps every way
    sender = collective_sender(CollectiveTransfer(backend="gloo", secret=SECRET), paths.root, ONE_RANK, torch.float32,
                              first_step=1)
    sparse_sender = collective_sender(CollectiveTransfer(backend="gloo", sparse=True, secret=SECRET), paths.root,
                                     ONE_RANK,
                                     torch.float32, first_step=1)
    bare = BareReceiver(sum(t.numel() * t.element_size() for t in perturbed(base, 0).values()), repeats)
    totals, bounds, parts, wire, wire_bounds, sparse, sparse_bytes = [], [], [], [], [], [], []
    bound_file = root / f"bound_{name}.safetensors"
    try:
        for step in range(1, 4 * repeats, 4):  # files, the wire, then sparse: whole, then changes
            state = perturbed(base, step)
            # Each write first frees the memory of the one it replaces (a new file each time, as publish writes
            # one): on this VM a write into memory not used lately can take 5x longer (a 400 MB save_file:
            # 0.13 s or up to 1.1 s, either side, at random), which swamps the difference measured. A sync
            # before each write: on a disk, neither write pays for flushing the other.
            bound_file.unlink(missing_ok=True)
            os.sync()
            write_start = time.perf_counter()
            save_file(state, str(bound_file))
            bound_write = time.perf_counter() - write_start
            if step > 1:  # as the trainer prunes old steps
                shutil.rmtree(paths.weights(step - 4))
            os.sync()
            start = time.perf_counter()
            publish_step(paths, step, single_process_shards(state, DEFAULT_SHARD_BYTES), side_files)  # as the trainer
            published = time.perf_counter()
            response = server.admin("POST", "/update_weights", json={"step": step, "path": str(paths.weights(step))})
            totals.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise RuntimeError(f"{name}: update to step {step} failed: {response.status_code} {response.text}")
            served = response.json()
            reload_s = served["reload_s"]
            bounds.append(bound_write + reload_s)
            timed = {"publish": published - start, "files": served["files_s"], "reload": reload_s,
                     "verify": served["verify_s"]}
            overlapped = reload_s  # the worker fingerprints the files as they pass to the reload
            parts.append(timed | {"rest": totals[-1] - timed["publish"] - overlapped - timed["verify"]})
            wire_s, wire_reload_s = send_over_the_wire(server, sender, paths.root, step + 1, perturbed(base, -step))
            wire.append(wire_s)
            wire_bounds.append(bare.broadcast_s(state) + wire_reload_s)
            whole = perturbed(base, step + 2)  # the server serves another sender's step: this one goes whole
            send_over_the_wire(server, sparse_sender, paths.root, step + 2, whole)
            stats: dict = {}
            sparse.append(send_over_the_wire(server, sparse_sender, paths.root, step + 3,
                                             changed_in_part(whole, changed, step), stats)[0])
            if not stats["transfer_sparse"]:
                raise RuntimeError(f"step {step + 3} went whole, not as its changes: {stats}")
            sparse_bytes.append(stats["transfer_bytes"])
    finally:
        server.stop()
        bare.close()
        sparse_sender.close()
    total, bound = statistics.median(totals), statistics.median(bounds)
    breakdown = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return {"model": name, "params": params, "publish_to_served_s": total, "lower_bound_s": bound,
            "ratio": total / bound, "breakdown": breakdown, "wire_s": statistics.median(wire),
            "wire_bound_s": statistics.median(wire_bounds), "sparse_s": statistics.median(sparse),
            "sparse_bytes": statistics.median(sparse_bytes), "changed": changed}


ONE_RANK = SimpleNamespace(is_main=True, rank=0, world_size=1, all_reduce=lambda values, op="sum": values)


def send_over_the_wire(server: Server, sender: CollectiveSender, run_dir: Path, step: int,
                       state: dict[str, torch.Tensor], stats: dict | None = None,
                       reply: dict | None = None) -> tuple[float, float]:
    """The trainer's send of `state` (the head too, as the trainer sends it) as step `step` and the orchestrator's
    take, timed from the offer to the server's answer; and the server's reload time. The sender's stats go into
    `stats`, the server's answer into `reply`."""
    stats = {} if stats is None else stats
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: stats.update(sender.send_tensors(step, list(state.items()))))
    thread.start()
    while (offer := read_offer(run_dir, step)) is None:
        time.sleep(0.001)
    write_take(run_dir, step, 1)
    transfer = {"host": offer.host, "port": offer.port, "rank": 1, "world_size": 2, "timeout_s": 60}
    response = server.admin("POST", "/update_weights", json={"step": step, "transfer": transfer})
    elapsed = time.perf_counter() - start
    thread.join()
    expected = stats.get("adapter_checksum", stats.get("weights_checksum"))  # an adapter's, as served
    if response.status_code != 200 or response.json()["weights_checksum"] != expected:
        raise RuntimeError(f"step {step} over the wire failed: {response.status_code} {response.text} {stats}")
    if reply is not None:
        reply.update(response.json())
    return elapsed, response.json()["reload_s"]


RECEIVER = """
import mmap, os, sys, torch, torch.distributed as dist
from datetime import timedelta
port, size, repeats = (int(a) for a in sys.argv[1:4])
store = dist.TCPStore(sys.argv[4], port, is_master=False, timeout=timedelta(seconds=600))
group = dist.ProcessGroupGloo(dist.PrefixStore("bare", store), 1, 2, timedelta(seconds=600))
for _ in range(repeats):  # each time into a fresh memfd, as a server receives a step
    fd = os.memfd_create("bare")
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as data:
        place = torch.frombuffer(data, dtype=torch.uint8)
        group.broadcast([place], dist.BroadcastOptions()).wait()
        del place
    os.close(fd)
"""


class BareReceiver:
    """The bound's transfer: a gloo broadcast of the step's bytes, in one piece, to another process (started once,
    so warm) receiving into a fresh memfd each time, as a server does; `prefix`: argv it runs under (the far side
    of a `SlowLink`), reaching this process at `host`."""

    def __init__(self, size: int, repeats: int, host: str = "127.0.0.1", prefix: list[str] | None = None):
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=600))
        self.process = subprocess.Popen([*(prefix or []), sys.executable, "-c", RECEIVER, str(self.store.port),
                                         str(size), str(repeats), host])
        self.group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("bare", self.store), 0, 2,
                                                        timedelta(seconds=600))

    def broadcast_s(self, state: dict[str, torch.Tensor]) -> float:
        data = torch.cat([tensor_bytes(v) for v in state.values()])
        start = time.perf_counter()
        self.group.broadcast([data], torch.distributed.BroadcastOptions()).wait()
        return time.perf_counter() - start

    def close(self) -> None:
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:  # a failed measurement left it waiting for a broadcast
            self.process.kill()
            self.process.wait()


def random_adapter(base: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank-`rank` adapter on every attention and MLP projection of `base`, under PEFT's names."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in DEFAULT_TARGETS:
            out_features, in_features = weight.shape
            tensors[tensor_name(module, "A")] = 0.01 * torch.randn(rank, in_features, generator=g)
            tensors[tensor_name(module, "B")] = 0.01 * torch.randn(out_features, rank, generator=g)
    return tensors


def measure_adapter_sync(root: Path, name: str, repeats: int, rank: int = 16) -> dict:
    """Publish-to-served of a LoRA adapter (written as the trainer writes one), and the server's reload time, on a
    server with LoRA on (the model `measure_sync` built)."""
    model_dir = root / name
    base = load_file(str(model_dir / "model.safetensors"))
    paths = RunPaths(root / f"run_{name}_lora")
    paths.weights_root.mkdir(parents=True)
    config = adapter_config_bytes(str(model_dir), rank, 2.0 * rank, 0.0, DEFAULT_TARGETS)
    server = Server(model_dir, paths.weights_root, root / f"inference_{name}_lora.log", timeout_s=900,
                    toml=f"[lora]\nmax_rank = {rank}\n[transfer]\nbackend = \"gloo\"\nsecret = \"{SECRET}\"\n")
    sender = collective_sender(CollectiveTransfer(backend="gloo", secret=SECRET), paths.root, ONE_RANK, torch.float32,
                              first_step=0, adapter_config=config)
    totals, reloads, sizes, wire = [], [], [], []
    try:
        for step in range(0, 2 * repeats, 2):  # files take the even steps, the wire the odd ones after them
            tensors = random_adapter(base, rank, step)
            shards = StepShards([ADAPTER_WEIGHTS], dict.fromkeys(tensors, ADAPTER_WEIGHTS), {ADAPTER_WEIGHTS: tensors},
                                sum(t.numel() * t.element_size() for t in tensors.values()),
                                {"adapter_checksum": adapter_checksum(tensors.items())})
            if step > 0:
                shutil.rmtree(paths.weights(step - 2))
            os.sync()
            start = time.perf_counter()
            publish_step(paths, step, shards, {ADAPTER_CONFIG: config})
            response = server.admin("POST", "/update_weights", json={"step": step, "path": str(paths.weights(step))})
            totals.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise RuntimeError(f"{name}: adapter step {step} failed: {response.status_code} {response.text}")
            reloads.append(response.json()["reload_s"])
            sizes.append(shards.total_bytes)
            wire.append(send_over_the_wire(server, sender, paths.root, step + 1, random_adapter(base, rank, -step))[0])
    finally:
        server.stop()
    return {"publish_to_served_s": statistics.median(totals), "reload_s": statistics.median(reloads),
            "bytes": sizes[0], "wire_s": statistics.median(wire)}


class AdamSteps:
    """Training steps as the trainer takes them at a small learning rate: AdamW on fp32 master weights (from random
    gradients), each step served in bf16, where most elements round to what they were (the head kept tied)."""

    def __init__(self, base: dict[str, torch.Tensor], lr: float, seed: int = 0):
        self.params = {k: v.float().clone().requires_grad_() for k, v in base.items() if k != "lm_head.weight"}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> dict[str, torch.Tensor]:
        for param in self.params.values():
            param.grad = torch.randn(param.shape, generator=self.generator)
        self.optimizer.step()
        state = {k: v.detach().to(torch.bfloat16) for k, v in self.params.items()}
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        return state


def changed_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in after)
    return changed / sum(t.numel() for t in after.values())


def measure_link(root: Path, name: str, repeats: int, rate: str, lr: float) -> dict:
    """Over a link limited to `rate` (a `SlowLink`: the server in another network namespace), `name`'s bf16 steps of
    AdamW at `lr`: publish-to-served whole and sparse (the step after one the same sender sent, so it goes as its
    changes), and the bound of the whole step (a bare gloo broadcast of its bytes over the same link + the server's
    reload). Rounds alternate which goes first."""
    model_dir = root / name
    if not model_dir.is_dir():
        build_tiny_model(model_dir, **MODELS[name])
    base = load_file(str(model_dir / "model.safetensors"))
    step_bytes = sum(t.numel() * 2 for t in perturbed(base, 0).values())  # in bf16, the tied head too, as sent
    link = SlowLink(rate)
    os.environ["GLOO_SOCKET_IFNAME"] = link.near_dev  # this process's gloo groups: on the link's near end
    paths = RunPaths(root / f"run_{name}_link")
    paths.weights_root.mkdir(parents=True)
    steps, senders, server, bare = AdamSteps(base, lr), [], None, None
    whole_s, sparse_s, bound_s, sparse_bytes, shares = [], [], [], [], []
    parts = {"whole": [], "sparse": []}  # where each step's time went, by the sender's and the server's own timers
    try:
        server = Server(model_dir, paths.weights_root, root / f"inference_{name}_link.log", timeout_s=900,
                        host=link.far, prefix=link.prefix,
                        toml=f'dtype = "bfloat16"\n[transfer]\nbackend = "gloo"\nsparse = true\nsecret = "{SECRET}"\n')
        wire = CollectiveTransfer(backend="gloo", host=link.near, secret=SECRET, timeout_s=300)
        whole = collective_sender(wire, paths.root, ONE_RANK, torch.bfloat16, first_step=1)
        senders.append(whole)
        sparse = collective_sender(wire.model_copy(update={"sparse": True}), paths.root, ONE_RANK, torch.bfloat16,
                                  first_step=1)
        senders.append(sparse)
        bare = BareReceiver(step_bytes, repeats, link.near, link.prefix)
        step = 1

        def send_whole() -> None:
            nonlocal step
            state, stats, reply = steps.next(), {}, {}
            elapsed, reload_s = send_over_the_wire(server, whole, paths.root, step, state, stats, reply)
            parts["whole"].append(step_parts(stats, reply))
            whole_s.append(elapsed)
            bound_s.append(bare.broadcast_s(state) + reload_s)
            step += 1

        def send_sparse() -> None:
            nonlocal step
            first = steps.next()  # the server serves the other sender's step: this one goes whole
            send_over_the_wire(server, sparse, paths.root, step, first)
            second, stats, reply = steps.next(), {}, {}
            sparse_s.append(send_over_the_wire(server, sparse, paths.root, step + 1, second, stats, reply)[0])
            parts["sparse"].append(step_parts(stats, reply))
            if not stats["transfer_sparse"]:
                raise RuntimeError(f"step {step + 1} went whole, not as its changes: {stats}")
            sparse_bytes.append(stats["transfer_bytes"])
            shares.append(changed_share(first, second))
            step += 2

        for round_ in range(repeats):
            for part in (send_sparse, send_whole) if round_ % 2 == 0 else (send_whole, send_sparse):
                part()
    finally:
        for sender in senders:
            sender.close()
        if server is not None:
            server.stop()
        if bare is not None:
            bare.close()
        del os.environ["GLOO_SOCKET_IFNAME"]
        link.close()
    return {"model": name, "rate": rate, "lr": lr, "whole_s": statistics.median(whole_s),
            "sparse_s": statistics.median(sparse_s), "bound_s": statistics.median(bound_s),
            "sparse_ratio": statistics.median(s / w for s, w in zip(sparse_s, whole_s)),
            "bound_ratio": statistics.median(w / b for w, b in zip(whole_s, bound_s)),
            "step_bytes": step_bytes, "sparse_bytes": statistics.median(sparse_bytes),
            "changed": statistics.median(shares),
            "parts": {kind: {k: statistics.median(p[k] for p in steps_) for k in steps_[0]}
                      for kind, steps_ in parts.items()}}


def step_parts(stats: dict, reply: dict) -> dict:
    """The sender's send (group, bytes, checksum) and the server's receive, reload and verification of one step."""
    return {"send": stats["transfer_s"], "receive": reply["receive_s"], "reload": reply["reload_s"],
            "verify": reply["verify_s"]}


def rate_text(rate: str) -> str:
    """tc's "1gbit" as "1 Gbit/s"."""
    number = rate.rstrip("abcdefghijklmnopqrstuvwxyz")
    return f"{number} {rate[len(number):].capitalize().replace('bit', 'bit/s')}"


async def generation_tokens_per_s(server: Server, prompts: int = 64, max_tokens: int = 64) -> float:
    body = lambda i: {  # noqa: E731
        "model": str(server.model),
        "token_ids": [1, 91, 89, 75, 88, 5] + [10 + (i * 7 + j) % 80 for j in range(8)] + [2, 5, 1, 71],
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "seed": i},
    }
    async with httpx.AsyncClient(timeout=600) as client:
        await client.post(f"{server.url}/inference/v1/generate", json=body(0))  # warm-up
        start = time.perf_counter()
        responses = await asyncio.gather(
            *(client.post(f"{server.url}/inference/v1/generate", json=body(i)) for i in range(prompts))
        )
        elapsed = time.perf_counter() - start
    tokens = sum(len(r.json()["choices"][0]["token_ids"]) for r in responses)
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--changed", type=float, default=0.02, help="share of elements a sparse step changes")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the models, weights and bound files are written (default: /dev/shm)")
    parser.add_argument("--link-rate", default="1gbit", help="the slow link's rate (tc syntax)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate for the steps over the link")
    parser.add_argument("--only-link", action="store_true", help="only the steps over the slow link")
    args = parser.parse_args()
    names = ["tiny"] if args.skip_large else ["tiny", "100M"]
    print(f"writing under {args.dir or tempfile.gettempdir()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        if args.only_link:
            print_link(root, names[-1], args)
            return
        results = [measure_sync(root, name, args.repeats, args.changed) for name in names]
        adapters = [measure_adapter_sync(root, name, args.repeats) for name in names]
        print("\nweight publish -> served (median of %d)" % args.repeats)
        for r in results:
            print(
                f"  {r['model']:>5} ({r['params'] / 1e6:.1f}M params): "
                f"publish-to-served {r['publish_to_served_s']:.3f}s, "
                f"lower bound (write + reload) {r['lower_bound_s']:.3f}s, ratio {r['ratio']:.2f}x (target <= 1.5x)"
            )
            print("        " + ", ".join(f"{k} {v:.3f}s" for k, v in r["breakdown"].items())
                  + "\n        (publish: write + CRC + STABLE; files: the files' fingerprint, in the worker as the"
                  " tensors pass to its reload (part of reload); verify: of the served weights, and the comparison;"
                  " rest: the server's read of the files with their CRC, header check and checksum, HTTP, RPCs)")
            print(f"        over the wire: publish-to-served {r['wire_s']:.3f}s "
                  f"({r['wire_s'] / r['publish_to_served_s']:.2f}x files), "
                  f"bound (bare gloo broadcast + reload) {r['wire_bound_s']:.3f}s, ratio "
                  f"{r['wire_s'] / r['wire_bound_s']:.2f}x (targets <= 0.5x files, <= 1.3x bound)")
            print(f"        sparse over the wire ({r['changed']:.0%} of elements changed): publish-to-served "
                  f"{r['sparse_s']:.3f}s ({r['sparse_s'] / r['publish_to_served_s']:.2f}x files, "
                  f"{r['sparse_s'] / r['wire_s']:.2f}x the whole step over the wire), "
                  f"{r['sparse_bytes'] / 2**20:.1f} MiB sent")
        print("\nLoRA adapter (rank 16, every projection) publish -> served vs full weights (median of %d)"
              % args.repeats)
        for r, a in zip(results, adapters):
            print(f"  {r['model']:>5}: adapter {a['bytes'] / 2**20:.1f} MiB, "
                  f"publish-to-served {a['publish_to_served_s']:.3f}s "
                  f"({a['publish_to_served_s'] / r['publish_to_served_s']:.2f}x full), reload {a['reload_s']:.3f}s "
                  f"({a['reload_s'] / r['breakdown']['reload']:.2f}x full); over the wire {a['wire_s']:.3f}s "
                  f"({a['wire_s'] / a['publish_to_served_s']:.2f}x files)")
        server = Server(root / "tiny", root / "run_tiny" / "weights", root / "inference_gen.log")
        try:
            rate = asyncio.run(generation_tokens_per_s(server))
        finally:
            server.stop()
        print(f"\nraw vLLM generation, tiny model, 64 prompts x 64 tokens in flight: {rate:.0f} tokens/s")
        last = results[-1]
        sparse_ratio = last["sparse_s"] / last["publish_to_served_s"]
        print(f"sparse collective publish-to-served {last['model']} {sparse_ratio:.2f}x filesystem "
              f"({last['changed']:.0%} of elements changed)")
        print(f"collective publish-to-served {last['model']} {last['wire_s'] / last['publish_to_served_s']:.2f}x "
              f"filesystem, {last['wire_s'] / last['wire_bound_s']:.2f}x bound")
        print_link(root, names[-1], args)


def print_link(root: Path, name: str, args: argparse.Namespace) -> None:
    """The steps over a slow link, or why they cannot be measured here; the last line."""
    why = why_no_link()
    if why is not None:
        print(f"\nsparse over a {rate_text(args.link_rate)} link: skipped, {why}")
        return
    r = measure_link(root, name, args.repeats, args.link_rate, args.lr)
    rate = rate_text(r["rate"])
    print(f"\nover a {rate} link (tc, network namespaces), {r['model']} in bf16, AdamW lr {r['lr']:g} "
          f"(median of {args.repeats}): {r['changed']:.1%} of elements changed per step")
    print(f"  whole step: {r['step_bytes'] / 2**20:.0f} MiB, publish-to-served {r['whole_s']:.3f}s; bound (bare gloo "
          f"broadcast over the link + reload) {r['bound_s']:.3f}s, {r['step_bytes'] / 2**20 / r['bound_s']:.0f} MiB/s")
    print(f"  sparse step: {r['sparse_bytes'] / 2**20:.1f} MiB sent, publish-to-served {r['sparse_s']:.3f}s")
    for kind, timed in r["parts"].items():
        print(f"    {kind}: " + ", ".join(f"{k} {v:.3f}s" for k, v in timed.items()))
    print(f"sparse publish-to-served {r['model']} {r['sparse_ratio']:.2f}x whole over {rate}, collective "
          f"{r['bound_ratio']:.2f}x bound")


if __name__ == "__main__":
    main()
