"""Publish the trainer's weights as weights/step_k/ in Hugging Face layout.

The full state dict is gathered from the FSDP shards; rank 0 writes safetensors, config and tokenizer
into a temporary directory, renames it into place and marks it STABLE, either at once or in a writer
thread while the next step trains. `lm_head.weight` is always
written, tied or not: vLLM's in-place reload leaves a tied head unloaded otherwise (install-facts).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rl.protocol import RunPaths, publish_dir, temp_path


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All ranks must call this; only rank 0 receives the tensors (on CPU)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def hf_side_files(model_config, tokenizer) -> dict[str, bytes]:
    """The config and tokenizer files `save_pretrained` writes, serialized once: they never change
    during a run, and serializing the config alone takes milliseconds, a real part of a small model's sync."""
    with tempfile.TemporaryDirectory() as tmp:
        model_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {str(p.relative_to(tmp)): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}


def save_hf_dir(directory: Path, state_dict: dict, side_files: dict[str, bytes]) -> None:
    """Write safetensors (lm_head.weight always included) and the config and tokenizer files into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, t in state_dict.items():  # safetensors refuses tensors that share memory (tied weights)
        tensors[name] = t.clone() if t.data_ptr() in seen else t.contiguous()
        seen.add(t.data_ptr())
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, data in side_files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def publish_weights(paths: RunPaths, step: int, state_dict: dict, side_files: dict[str, bytes]) -> None:
    """Rank 0 only: write weights/step_{step}/ atomically."""
    final = paths.weights(step)
    tmp = temp_path(final)
    save_hf_dir(tmp, state_dict, side_files)
    publish_dir(tmp, final)


class WeightPublisher:
    """Rank 0's writer of weights/step_k/. With `background`, each write runs in one writer thread while the
    next step trains: at most one write is in flight, on a private copy of the tensors (the optimizer updates
    the parameters in place), and a failed write is raised by the next publish, by `wait` or by `close`."""

    def __init__(self, paths: RunPaths, model_config, tokenizer, background: bool):
        self._args = (paths, hf_side_files(model_config, tokenizer))
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="publish-weights") if background else None
        self._pending: Future | None = None

    def publish(self, step: int, state_dict: dict[str, torch.Tensor]) -> None:
        paths, side_files = self._args
        if self._writer is None:
            publish_weights(paths, step, state_dict, side_files)
            return
        self.wait()
        private = {name: t.clone() for name, t in state_dict.items()}
        self._pending = self._writer.submit(publish_weights, paths, step, private, side_files)

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
