"""The image inputs of a vision-language model's samples: for each image a rollout's messages held, the pixel values
and patch grid the trainer's vision tower takes, made by the model's own image processor as vLLM made them when it
served the request. vLLM expanded each image's placeholder into one token per merged group of patches; the sample's
tokens must hold exactly that many, which is checked here, so a processor that differs from the server's fails by
name instead of training on images it never saw."""

from __future__ import annotations

import base64
import binascii
import functools
import io

import torch

DATA_URL = "data:image/"


class ImageInputs:
    """A model's image processor and what its config says of image tokens."""

    def __init__(self, model: str):
        from transformers import AutoConfig, AutoImageProcessor

        from rl.config import local_model_dir

        config = AutoConfig.from_pretrained(local_model_dir(model))
        if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
            raise ValueError(f"a rollout holds images, but {model} is not a vision-language model "
                             f"({type(config).__name__} has no vision tower)")
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        self.processor = AutoImageProcessor.from_pretrained(local_model_dir(model))

    def __call__(self, urls: list[str], input_ids: list[int], sampled: list[int]) -> dict[str, torch.Tensor]:
        """`pixel_values` [patches, D] float32 and `image_grid_thw` [images, 3] of the images at `urls`, in order;
        ValueError where the tokens do not hold as many image tokens as the images make, `ImageTokenSampled` where
        the policy sampled one (`sampled`: 1 per sampled token): the trainer's model would read it as an image's."""
        if any(s and token == self.image_token_id for token, s in zip(input_ids, sampled, strict=True)):
            raise ImageTokenSampled("the policy sampled an image placeholder token")
        made = self.processor(images=[decode_image(url) for url in urls], return_tensors="pt")
        grid = made["image_grid_thw"].long()
        expected, found = int((grid.prod(-1) // self.merge**2).sum()), input_ids.count(self.image_token_id)
        if expected != found:
            raise ValueError(f"a sample's {len(urls)} images make {expected} image tokens here, but the server "
                             f"expanded them into {found}: the orchestrator's image processor differs from vLLM's")
        return {"pixel_values": made["pixel_values"].float(), "image_grid_thw": grid}


class ImageTokenSampled(ValueError):
    """A rollout with images whose policy sampled the image placeholder: left out (the rest of its group trains)."""


@functools.lru_cache(maxsize=4)
def image_inputs(model: str) -> ImageInputs:
    return ImageInputs(model)


def decode_image(url: str):
    """A PIL image from a base64 data URL (`data:image/png;base64,...`), the form environments send images in."""
    from PIL import Image, UnidentifiedImageError

    head, _, payload = url.partition(",")
    if not head.startswith(DATA_URL) or not head.endswith(";base64"):
        raise ValueError(f"an image URL must be a base64 data URL (data:image/...;base64,...), not {url[:60]!r}: "
                         "the trainer needs its pixels, which rl does not fetch")
    try:
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True))).convert("RGB")
    except (binascii.Error, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"an image data URL ({head}) does not decode to an image: {e}") from None
