"""Publish the trainer's weights as weights/step_k/ in Hugging Face layout, every rank writing its own shards.

The weights are split into safetensors shards of at most `shard_bytes` (one `model.safetensors` when they fit,
else `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json`, as `save_pretrained` writes them);
shard i belongs to rank i mod world size. Every tensor is cast to the dtype inference serves before it is
gathered (bf16 halves what crosses the network and what is written), and only its shard's owner keeps it.
Each rank writes its shards into the step's partial directory (`weights/.step_k.tmp`), taking each file's size and
CRC-32 as it writes it, and records them beside the shard; rank 0 adds the config, tokenizer and index, waits for
every shard's record, renames the directory into place and marks it STABLE with the writers' CRCs (no rank reads a
shard again). Only a shard's owner copies its tensors to the host. With
`background`, the writes run in one writer thread per rank while the next step trains.

`lm_head.weight` is always written, tied or not: vLLM's in-place reload leaves a tied head unloaded otherwise
(install-facts).

With LoRA the step holds the adapter instead (PEFT layout, rl/adapter.py: a few MB, gathered whole and written
by rank 0), its checksum recorded in the STABLE marker; or, with `lora.publish_merged`, the merged full weights
(W + scaled B A per adapted layer) through the path above.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_checksum, adapter_config_bytes
from rl.atomic import atomic_write, atomic_write_text
from rl.config import local_model_dir
from rl.manifest import Entry
from rl.protocol import RunPaths, publish_dir
from rl.safetensors_io import TIED_HEAD, tied_head_source, write_file
from rl.trainer.config import TrainerConfig
from rl.trainer.lora import LoRALinear, adapter_tensors, full_tensor, lora_layers, merged_weight
from rl.trainer.world import World
from rl.weights import Sender

DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size
SHARD_WAIT_S = 900  # longest rank 0 waits for another rank's shards of a step
INDEX = "model.safetensors.index.json"


@dataclass
class StepShards:
    """One rank's part of a published step: the step's shard files and where each tensor lives, and the
    tensors of the shards this rank owns (on the CPU)."""

    files: list[str]
    weight_map: dict[str, str]  # tensor name -> shard file
    mine: dict[str, dict[str, torch.Tensor]]  # shard file -> its tensors, for the shards this rank writes
    total_bytes: int  # of every tensor of the step, all ranks' shards
    marker_info: dict[str, str] | None = None  # recorded in the step's STABLE marker (an adapter's checksum)


def with_tied_head(names: list[str]) -> dict[str, str]:
    """Tensor name written -> state-dict name it comes from: every name, plus `lm_head.weight` from the embedding
    when the state dict lacks it (tied)."""
    sources = {name: name for name in names}
    embedding = tied_head_source(names)
    if embedding is not None:
        sources[TIED_HEAD] = embedding
    return sources


def shard_layout(sizes: list[tuple[str, int]], max_bytes: int) -> tuple[list[str], list[list[str]], dict[str, str]]:
    """The step's shard files, the tensor names in each, and tensor name -> file."""
    plan = shard_plan(sizes, max_bytes)
    files = shard_names(len(plan))
    return files, plan, {name: file for file, names in zip(files, plan, strict=True) for name in names}


def single_process_shards(state: dict[str, torch.Tensor], max_bytes: int) -> StepShards:
    """A whole state dict as one process's shards (tools and tests; the trainer uses `gather_shards`)."""
    sources = with_tied_head(list(state))
    sizes = [(name, state[src].numel() * state[src].element_size()) for name, src in sources.items()]
    files, plan, weight_map = shard_layout(sizes, max_bytes)
    mine = {file: {name: state[sources[name]].contiguous().clone() for name in names}
            for file, names in zip(files, plan, strict=True)}
    return StepShards(files, weight_map, mine, sum(size for _, size in sizes))


def shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most `max_bytes` (a larger tensor gets a shard of its own), in order."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def gather_shards(model: torch.nn.Module, dtype: torch.dtype, world: World, max_bytes: int) -> StepShards:
    """Collective: every rank calls it. Each tensor is cast to `dtype` on its local shard, then gathered; the
    owner of its shard keeps the full tensor (on the CPU), the others drop it at once. LoRA layers are
    published merged (their A and B are not tensors of the base model)."""
    sources = dict(published_sources(model))
    sizes = [(name, weight_of(src).numel() * dtype.itemsize) for name, src in sources.items()]
    files, plan, weight_map = shard_layout(sizes, max_bytes)
    mine: dict[str, dict[str, torch.Tensor]] = {}
    for index, (file, names) in enumerate(zip(files, plan, strict=True)):
        owner = index % world.world_size == world.rank
        for name in names:
            src = sources[name]
            # every rank takes part in the gather; only the shard's owner copies the tensor to the host
            full = merged_weight(src, dtype) if isinstance(src, LoRALinear) else full_tensor(src, dtype, to_host=owner)
            if owner:
                mine.setdefault(file, {})[name] = full
    return StepShards(files, weight_map, mine, sum(size for _, size in sizes))


def published_sources(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | LoRALinear]]:
    """(name published, what it is gathered from) in state-dict order: `lm_head.weight` included when tied, a LoRA
    layer under its base weight's name (published merged); the same for files and for the wire."""
    state = model.state_dict()
    merged = {f"{name}.weight": layer for name, layer in lora_layers(model).items()}
    names = [name for name in state if not name.endswith((".lora_A", ".lora_B"))]
    return [(name, merged.get(source, state[source])) for name, source in with_tied_head(names).items()]


def weight_of(source: torch.Tensor | LoRALinear) -> torch.Tensor:
    return source.weight if isinstance(source, LoRALinear) else source


def gather_adapter(model: torch.nn.Module, dtype: torch.dtype, world: World) -> StepShards:
    """Collective: the LoRA adapter in `dtype` as one file that rank 0 writes, with its checksum for the marker."""
    tensors = adapter_tensors(model, dtype)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    mine = {ADAPTER_WEIGHTS: tensors} if world.is_main else {}
    info = {"adapter_checksum": adapter_checksum(tensors.items())} if world.is_main else None
    return StepShards([ADAPTER_WEIGHTS], dict.fromkeys(tensors, ADAPTER_WEIGHTS), mine, total, info)


def adapted_leaves(model: torch.nn.Module) -> list[str]:
    """adapter_config.json's target_modules: the last name of every adapted layer (q_proj, ...)."""
    return sorted({name.rpartition(".")[2] for name in lora_layers(model)})


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def hf_side_files(model_config, tokenizer) -> dict[str, bytes]:
    """The config and tokenizer files `save_pretrained` writes, serialized once: they never change
    during a run, and serializing the config alone takes milliseconds, a real part of a small model's sync. A
    vision-language model's image processor settings come as the base model has them."""
    with tempfile.TemporaryDirectory() as tmp:
        model_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {str(p.relative_to(tmp)): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}
    base = Path(local_model_dir(tokenizer.name_or_path))
    return files | {name: (base / name).read_bytes() for name in PROCESSOR_FILES if (base / name).is_file()}


FORMAT = {"format": "pt"}  # safetensors metadata transformers expects


def write_shards(directory: Path, shards: StepShards) -> dict[str, Entry]:
    """This rank's shard files, each written under a temporary name and renamed, its size and CRC-32 taken as it
    is written (`safetensors_io.write_file`: no second pass over the bytes)."""
    written = {}
    for file, tensors in shards.mine.items():
        def write(tmp, tensors=tensors, file=file):
            written[file] = Entry(*write_file(tmp, tensors, FORMAT))
        atomic_write(directory / file, write)
    return written


def written_record(file: str) -> str:
    """The name of the small file recording a shard's size and CRC-32 beside it, until rank 0 marks the step."""
    return f".{file}.written.json"


def record_written(directory: Path, written: dict[str, Entry]) -> None:
    """Tell rank 0 each shard's size and CRC-32 (written after the shard: rank 0 waits for these names)."""
    for file, entry in written.items():
        atomic_write_text(directory / written_record(file), json.dumps({"bytes": entry.bytes, "crc32": entry.crc32}))


def take_written(directory: Path, files: list[str]) -> dict[str, Entry]:
    """Rank 0: every shard's record, removed from the step (the marker lists them instead)."""
    written = {}
    for file in files:
        record = directory / written_record(file)
        entry = json.loads(record.read_text())
        written[file] = Entry(entry["bytes"], entry["crc32"])
        record.unlink()
    return written


def write_side_files(directory: Path, shards: StepShards, side_files: dict[str, bytes]) -> None:
    """The config and tokenizer files, and the shards' index when there are several."""
    for name, data in side_files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    if len(shards.files) > 1:
        index = {"metadata": {"total_size": shards.total_bytes}, "weight_map": shards.weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2))


def finish_step(paths: RunPaths, step: int, shards: StepShards, side_files: dict[str, bytes], timeout_s: float) -> None:
    """Rank 0: the config, tokenizer and index files, then, once every rank's shards are there, the step in place."""
    directory = paths.partial_weights(step)
    write_side_files(directory, shards, side_files)
    deadline = time.monotonic() + timeout_s
    while missing := [f for f in shards.files if not (directory / written_record(f)).is_file()]:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for the other ranks' shards of step {step}: {missing} never appeared"
            )
        time.sleep(0.05)
    written = take_written(directory, shards.files)
    publish_dir(directory, paths.weights(step), written, **(shards.marker_info or {}))


def publish_step(paths: RunPaths, step: int, shards: StepShards, side_files: dict[str, bytes]) -> None:
    """One process holding every shard: write weights/step_k/ at once (tools and tests)."""
    directory = paths.partial_weights(step)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    record_written(directory, write_shards(directory, shards))
    finish_step(paths, step, shards, side_files, timeout_s=0)


def save_model_dir(model: torch.nn.Module, directory: Path, side_files: dict[str, bytes], world: World,
                   dtype: torch.dtype, shard_bytes: int) -> None:
    """Collective: `model` in Hugging Face layout in `directory` (SFT's output), every rank writing its shards."""
    if world.is_main:
        directory.mkdir(parents=True, exist_ok=True)
    shards = gather_shards(model, dtype, world, shard_bytes)
    write_shards(directory, shards)
    if world.is_main:
        write_side_files(directory, shards, side_files)
    world.barrier()


class WeightPublisher:
    """Every rank's writer of its part of weights/step_k/ (rank 0 also completes the step). With `background`,
    each write runs in one writer thread while the next step trains: at most one write is in flight, and a
    failed write is raised by the next publish, by `wait` or by `close`. `adapter`: publish the LoRA adapter
    (with its adapter_config.json) instead of the model's weights."""

    def __init__(self, paths: RunPaths, model_config, tokenizer, world: World, dtype: torch.dtype, shard_bytes: int,
                 background: bool, timeout_s: float = SHARD_WAIT_S, adapter_config: bytes | None = None):
        self.paths, self.world, self.dtype = paths, world, dtype
        self.shard_bytes, self.timeout_s = shard_bytes, timeout_s
        self.adapter = adapter_config is not None
        self.adapter_config = adapter_config  # adapter_config.json's bytes, on every rank
        if not world.is_main:
            self.side_files = {}
        else:
            self.side_files = (
                {ADAPTER_CONFIG: adapter_config} if self.adapter else hf_side_files(model_config, tokenizer)
            )
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="publish-weights") if background else None
        self._pending: Future | None = None

    @classmethod
    def for_config(cls, config: TrainerConfig, paths: RunPaths, model, tokenizer, world: World) -> WeightPublisher:
        """What the trainer publishes: the adapter with LoRA (unless `publish_merged`), else full weights."""
        lora = config.lora
        adapter = None
        if lora is not None and not lora.publish_merged:
            adapter = adapter_config_bytes(
                config.model.name, lora.rank, lora.alpha, lora.dropout, adapted_leaves(model)
            )
        return cls(paths, model.config, tokenizer, world, getattr(torch, config.publish_dtype),
                   int(config.publish_shard_gib * 2**30), config.publish_in_background, adapter_config=adapter)

    def publish(self, step: int, model: torch.nn.Module) -> str | None:
        """Collective: gather this rank's shards of `model` and write them (at once, or in the writer thread).
        Returns the adapter's checksum on rank 0 when publishing an adapter."""
        self.wait()
        if self.world.is_main:  # before the gather: no rank can write into it before rank 0 joins the gather
            shutil.rmtree(self.paths.partial_weights(step), ignore_errors=True)
            self.paths.partial_weights(step).mkdir(parents=True)
        if self.adapter:
            shards = gather_adapter(model, self.dtype, self.world)
        else:
            shards = gather_shards(model, self.dtype, self.world, self.shard_bytes)
        if self._writer is None:
            self._write(step, shards)
        else:
            self._pending = self._writer.submit(self._write, step, shards)
        return (shards.marker_info or {}).get("adapter_checksum")

    def _write(self, step: int, shards: StepShards) -> None:
        record_written(self.paths.partial_weights(step), write_shards(self.paths.partial_weights(step), shards))
        if self.world.is_main:
            finish_step(self.paths, step, shards, self.side_files, self.timeout_s)

    def wait(self) -> None:
        """Block until the write in flight, if any, is on disk (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()


class FilesSender(Sender):
    """The filesystem transport's sender: every step's weights as files in weights/step_k/, which servers read."""

    def __init__(self, publisher: WeightPublisher):
        self.publisher = publisher

    @classmethod
    def create(cls, config: TrainerConfig, publisher: WeightPublisher, world: World, first_step: int) -> FilesSender:
        return cls(publisher)

    def publish(self, step: int, model: torch.nn.Module) -> dict:
        checksum = self.publisher.publish(step, model)
        return {"adapter_checksum": checksum} if checksum else {}  # of weights/step_k, as inference reports it
