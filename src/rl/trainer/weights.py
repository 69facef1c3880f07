"""Publish the trainer's weights as weights/step_k/ in Hugging Face layout.

The full state dict is gathered from the FSDP shards; rank 0 writes safetensors, config and tokenizer
into a temporary directory, renames it into place and marks it STABLE. `lm_head.weight` is always
written, tied or not: vLLM's in-place reload leaves a tied head unloaded otherwise (install-facts).
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rl.protocol import RunPaths, publish_dir, temp_path


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All ranks must call this; only rank 0 receives the tensors (on CPU)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_hf_dir(directory, state_dict: dict, model_config, tokenizer) -> None:
    """Write safetensors (lm_head.weight always included), config and tokenizer into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, t in state_dict.items():  # safetensors refuses tensors that share memory (tied weights)
        tensors[name] = t.clone() if t.data_ptr() in seen else t.contiguous()
        seen.add(t.data_ptr())
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def publish_weights(paths: RunPaths, step: int, state_dict: dict, model_config, tokenizer) -> None:
    """Rank 0 only: write weights/step_{step}/ atomically."""
    final = paths.weights(step)
    tmp = temp_path(final)
    save_hf_dir(tmp, state_dict, model_config, tokenizer)
    publish_dir(tmp, final)
