"""The rollout batch format: a `Sample` is one rollout as the trainer sees it, and a step's file for a rank is its
samples flattened into tensors (`encode_samples`), checked field by field when read (`check_batch`,
`decode_samples`). rl/protocol.py writes and reads the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a batch is encoded or decoded: the launcher needs none
    import torch


@dataclass
class Sample:
    """One rollout as the trainer sees it: prompt and completion tokens in one sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 where the policy sampled the token (it is trained on)
    logprobs: list[float]  # inference logprob of each token (0 where loss_mask is 0)
    advantage: float
    reward: float
    policy_version: int
    teacher_logprobs: list[float] | None = None  # a teacher's logprob of each token (on-policy distillation)
    # and, per token, its k likeliest tokens given the ones before (teacher.top_k > 0): ids and logprobs, [T][k]
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    token_versions: list[int] | None = None  # the policy version behind each token (its sampler's, where sampled)
    # MoE: the experts inference routed each token to, [T, layers, top_k] int16 (-1: not recorded); router replay
    routed_experts: torch.Tensor | None = None
    # A vision-language model's images, in the order of their placeholder runs in input_ids, as its image processor
    # made them: pixel_values [patches, channels * temporal * patch * patch] float32, image_grid_thw [images, 3]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # inference's logprob of each token under the policy the batch trains (re-scored by prefill where the sample
    # is older: orchestrator/rescore.py), for a mask against = "rescored"; 0 where loss_mask is 0
    rescored_logprobs: list[float] | None = None

    def __post_init__(self):
        if not len(self.input_ids) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError("input_ids, loss_mask and logprobs must have the same length")
        if self.token_versions is not None and len(self.token_versions) != len(self.input_ids):
            raise ValueError("token_versions must have one entry per token")
        if self.routed_experts is not None and (self.routed_experts.ndim != 3
                                                or len(self.routed_experts) != len(self.input_ids)):
            raise ValueError("routed_experts must be [tokens, layers, top_k], one row per token")
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw come together")
        if self.image_grid_thw is not None:
            grid = self.image_grid_thw
            if grid.ndim != 2 or grid.shape[1] != 3 or not len(grid) or (grid <= 0).any():
                raise ValueError(f"image_grid_thw must be [images, 3] of positive sizes, not {grid.tolist()[:4]}")
            if self.pixel_values.ndim != 2 or len(self.pixel_values) != int(grid.prod(-1).sum()):
                raise ValueError(f"pixel_values {list(self.pixel_values.shape)} must hold one row per patch of "
                                 f"image_grid_thw ({int(grid.prod(-1).sum())})")
        for name in ("teacher_logprobs", "rescored_logprobs"):
            if getattr(self, name) is not None and len(getattr(self, name)) != len(self.input_ids):
                raise ValueError(f"{name} must have one entry per token")
        if (self.teacher_top_ids is None) != (self.teacher_top_logprobs is None):
            raise ValueError("teacher_top_ids and teacher_top_logprobs come together")
        if self.teacher_top_ids is not None:
            rows = [*self.teacher_top_ids, *self.teacher_top_logprobs]
            if not len(self.teacher_top_ids) == len(self.teacher_top_logprobs) == len(self.input_ids):
                raise ValueError("teacher_top_ids and teacher_top_logprobs must have one row per token")
            if not rows[0] or any(len(row) != len(rows[0]) for row in rows):
                raise ValueError("teacher_top_ids and teacher_top_logprobs rows must all hold the same k > 0 entries")


def carried(samples: list[Sample], field: str, what: str) -> bool:
    """Whether every sample carries `field` (the batch has it) rather than none; some but not all is refused."""
    has = [getattr(s, field) is not None for s in samples]
    if any(has) and not all(has):
        raise ValueError(f"{has.count(False)} of {len(samples)} samples lack {what} the others have")
    return bool(samples) and all(has)


def encode_samples(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Flatten samples into tensors: tokens concatenated, per-sample values in parallel arrays; `teacher_logprobs`
    only where every sample has them, `token_policy_versions` only where every sample has its `token_versions`."""
    import torch

    teacher = {"teacher_logprobs": torch.tensor([lp for s in samples for lp in s.teacher_logprobs],
                                                dtype=torch.float32)} \
        if carried(samples, "teacher_logprobs", "the teacher logprobs") else {}
    ranked = carried(samples, "teacher_top_ids", "the teacher's top-k")
    if carried(samples, "rescored_logprobs", "the rescored logprobs"):
        teacher["rescored_logprobs"] = torch.tensor([lp for s in samples for lp in s.rescored_logprobs],
                                                    dtype=torch.float32)
    if samples and all(s.token_versions is not None for s in samples):
        teacher["token_policy_versions"] = torch.tensor([v for s in samples for v in s.token_versions],
                                                        dtype=torch.int64)  # [T]
    if carried(samples, "routed_experts", "the routed experts"):
        teacher["routed_experts"] = torch.cat([s.routed_experts.to(torch.int16) for s in samples])  # [T, L, k]
    teacher |= encode_images(samples)
    if ranked:
        teacher |= {  # [T, k]
            "teacher_top_ids": torch.tensor([row for s in samples for row in s.teacher_top_ids], dtype=torch.int64),
            "teacher_top_logprobs": torch.tensor([row for s in samples for row in s.teacher_top_logprobs],
                                                 dtype=torch.float32),
        }
    return teacher | {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int64),  # [T]
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),  # [T]
        "logprobs": torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32),  # [T]
        "lengths": torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64),  # [N]
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),  # [N]
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),  # [N]
        "policy_versions": torch.tensor([s.policy_version for s in samples], dtype=torch.int64),  # [N]
    }


def encode_images(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Where any sample has images: every sample's patches and grids concatenated, and how many images each has."""
    import torch

    seen = [s for s in samples if s.image_grid_thw is not None]
    if not seen:
        return {}
    return {
        "pixel_values": torch.cat([s.pixel_values.float() for s in seen]),  # [patches, D]
        "image_grid_thw": torch.cat([s.image_grid_thw.long() for s in seen]),  # [images, 3]
        "image_counts": torch.tensor([0 if s.image_grid_thw is None else len(s.image_grid_thw) for s in samples],
                                     dtype=torch.int64),  # [N]
    }


IMAGE_FIELDS = {"pixel_values": ("float32", 2), "image_grid_thw": ("int64", 2), "image_counts": ("int64", 1)}


def check_images(tensors: dict[str, torch.Tensor]) -> None:
    """A batch's image fields: all or none, each of its dtype and shape, their counts agreeing."""
    import torch

    present = [name for name in IMAGE_FIELDS if name in tensors]
    if present and len(present) < len(IMAGE_FIELDS):
        raise ValueError(f"the batch holds {', '.join(present)} without the other image fields")
    if not present:
        return
    for name, (dtype, ndim) in IMAGE_FIELDS.items():
        if tensors[name].dtype != getattr(torch, dtype) or tensors[name].ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-dimensional {dtype}, not {tensors[name].dtype} "
                             f"{list(tensors[name].shape)}")
    counts, grid, pixels = tensors["image_counts"], tensors["image_grid_thw"], tensors["pixel_values"]
    if len(counts) != len(tensors["lengths"]) or (counts < 0).any() or int(counts.sum()) != len(grid):
        raise ValueError(f"image_counts {counts.tolist()[:10]} do not count the {len(grid)} images of "
                         f"{len(tensors['lengths'])} samples")
    if grid.shape[1:] != (3,) or (grid <= 0).any() or int(grid.prod(-1).sum()) != len(pixels):
        raise ValueError(f"image_grid_thw must be [images, 3] of positive sizes whose patches are the "
                         f"{len(pixels)} rows of pixel_values")
    if not torch.isfinite(pixels).all():
        raise ValueError("pixel_values holds NaN or infinity")


def decode_images(tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each sample's (pixel_values, image_grid_thw), or (None, None) for one without images."""
    lengths = tensors["lengths"]
    if "image_counts" not in tensors:
        return [(None, None)] * len(lengths)
    grids = tensors["image_grid_thw"].split(tensors["image_counts"].tolist())
    pixels = tensors["pixel_values"].split([int(grid.prod(-1).sum()) for grid in grids])
    return [(p, g) if len(g) else (None, None) for p, g in zip(pixels, grids, strict=True)]


BATCH_FIELDS = {  # name -> (torch dtype, counted per token or per sample, dimensions)
    "input_ids": ("int64", "token", 1),
    "loss_mask": ("bool", "token", 1),
    "logprobs": ("float32", "token", 1),
    "lengths": ("int64", "sample", 1),
    "advantages": ("float32", "sample", 1),
    "rewards": ("float32", "sample", 1),
    "policy_versions": ("int64", "sample", 1),
}
OPTIONAL_FIELDS = {  # on-policy distillation: [T], and [T, k] with teacher.top_k
    "teacher_logprobs": ("float32", "token", 1),
    "teacher_top_ids": ("int64", "token", 2),
    "teacher_top_logprobs": ("float32", "token", 2),
    "token_policy_versions": ("int64", "token", 1),  # Sample.token_versions
    "routed_experts": ("int16", "token", 3),  # Sample.routed_experts
    "rescored_logprobs": ("float32", "token", 1),  # Sample.rescored_logprobs
}


def check_batch(tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first field that does not fit the batch format."""
    import torch

    fields = BATCH_FIELDS | {name: spec for name, spec in OPTIONAL_FIELDS.items() if name in tensors}
    if ("teacher_top_ids" in tensors) != ("teacher_top_logprobs" in tensors):
        raise ValueError("the batch holds one of teacher_top_ids and teacher_top_logprobs without the other")
    for name, (dtype, _, ndim) in fields.items():
        if name not in tensors:
            raise ValueError(f"the batch lacks {name}")
        tensor = tensors[name]
        if tensor.dtype != getattr(torch, dtype):
            raise ValueError(f"{name} must be {dtype}, not {tensor.dtype}")
        if tensor.ndim != ndim:
            words = ("one", "two", "three")[ndim - 1]
            raise ValueError(f"{name} must be {words}-dimensional, not of shape {list(tensor.shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or infinity")
    lengths = tensors["lengths"].tolist()  # Python integers: a sum of int64 lengths could overflow
    if any(n <= 0 for n in lengths):
        raise ValueError(f"lengths must be positive: {lengths[:10]}")
    counts = {"token": sum(lengths), "sample": len(lengths)}
    for name, (_, per, _) in fields.items():
        if tensors[name].shape[0] != counts[per]:
            raise ValueError(f"{name} has {tensors[name].shape[0]} entries for {counts[per]} {per}s")
    if "teacher_top_ids" in tensors:
        ids, logprobs = tensors["teacher_top_ids"], tensors["teacher_top_logprobs"]
        if ids.shape != logprobs.shape or not ids.shape[1]:
            raise ValueError(f"teacher_top_ids {list(tensors['teacher_top_ids'].shape)} and teacher_top_logprobs "
                             f"{list(tensors['teacher_top_logprobs'].shape)} must both be [tokens, k], k > 0")
    check_images(tensors)


def decode_samples(tensors: dict[str, torch.Tensor]) -> list[Sample]:
    check_batch(tensors)
    lengths = tensors["lengths"].tolist()
    ids, mask, lps = (tensors[k].split(lengths) for k in ("input_ids", "loss_mask", "logprobs"))
    teacher, top_ids, top_logprobs, versions, routed = (
        tensors[k].split(lengths) if k in tensors else [None] * len(lengths)
        for k in ("teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs", "token_policy_versions",
                  "routed_experts"))
    rescored = tensors["rescored_logprobs"].split(lengths) if "rescored_logprobs" in tensors else [None] * len(lengths)
    return [
        Sample(i.tolist(), m.int().tolist(), lp.tolist(), a, r, v,
               *(None if x is None else x.tolist() for x in (t, ti, tl, tv)), re, *images,
               rescored_logprobs=None if rs is None else rs.tolist())
        for i, m, lp, a, r, v, t, ti, tl, tv, re, images, rs in zip(
            ids,
            mask,
            lps,
            tensors["advantages"].tolist(),
            tensors["rewards"].tolist(),
            tensors["policy_versions"].tolist(),
            teacher,
            top_ids,
            top_logprobs,
            versions,
            routed,
            decode_images(tensors),
            rescored,
            strict=True,
        )
    ]
