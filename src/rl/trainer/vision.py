"""A vision-language model (Qwen3.5 as its checkpoints ship: a vision tower beside the language model) in the
trainer. Its vision tower is frozen unless `train_vision` (prime-rl's default too): the policy is the language
model, and the tower's features of a prompt's images are inputs. It stays in the root's FSDP group, so every rank
gathers it on every forward whether or not its rows hold images: no rank waits on a gather another skips.

Image tokens get 3-D rotary positions (time, height, width) from the image's patch grid, as vLLM gave them when it
sampled: each sample's are computed on its own (packed rows restart every sample at 0) by the model's own
`get_rope_index`, beside the plain positions that keep packed samples apart (the text model's first row)."""

from __future__ import annotations

import torch
from torch import nn

VISION_ATTENTION = "sdpa"  # the tower's: it splits its patches by image itself; rl's packed attention is the text's


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack: a causal LM's `model`, a vision-language model's `model.language_model`."""
    return getattr(model.model, "language_model", model.model)


def prepare_vision(model: nn.Module, trainable: bool) -> None:
    """The vision tower's own attention, and frozen unless `trainable`."""
    if not is_vision_language(model.config):
        if trainable:
            raise ValueError(f"train_vision is set, but {type(model).__name__} has no vision tower")
        return
    model.config.vision_config._attn_implementation = VISION_ATTENTION
    model.model.visual.requires_grad_(trainable)


def vision_forward_inputs(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          sample_lengths: tuple[int, ...] | None, pixel_values: torch.Tensor,
                          image_grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for a micro-batch with images: the pixels and grids, and position ids [4, B, T]:
    the plain positions, then time, height and width, sample by sample. `sample_lengths` describes a packed row
    [1, T]; None: padded rows, one sample each (padding keeps position 0)."""
    spans = _sample_spans(input_ids.shape, sample_lengths)
    rope = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    image_token, grids = model.config.image_token_id, iter(image_grid_thw)
    for row, start, end in spans:
        ids = input_ids[row, start:end]
        is_image = ids == image_token
        tokens = int(is_image.sum())
        if tokens == 0:
            rope[:, row, start:end] = position_ids[row, start:end]
            continue
        grid = _grids_for(tokens, grids, model.config.vision_config.spatial_merge_size)
        positions, _ = model.model.get_rope_index(ids[None], is_image.int()[None], image_grid_thw=grid)
        rope[:, row, start:end] = positions[:, 0]
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
            "position_ids": torch.cat([position_ids[None], rope])}


def _sample_spans(shape: torch.Size, sample_lengths: tuple[int, ...] | None) -> list[tuple[int, int, int]]:
    if sample_lengths is None:
        return [(row, 0, shape[1]) for row in range(shape[0])]
    starts = torch.tensor((0, *sample_lengths)).cumsum(0).tolist()
    return [(0, start, end) for start, end in zip(starts[:-1], starts[1:])]


def _grids_for(wanted: int, grids, merge: int) -> torch.Tensor:
    """The next grids of the micro-batch's images, as many as make `wanted` (a sample's) image tokens."""
    taken = []
    while wanted > 0:
        grid = next(grids, None)
        if grid is None:
            raise ValueError("a sample holds more image tokens than its micro-batch's images make")
        taken.append(grid)
        wanted -= int(grid.prod()) // merge**2
    if wanted:
        raise ValueError("a sample's image tokens end inside an image's grid")
    return torch.stack(taken)
