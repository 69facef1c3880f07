"""rl's change to transformers, in each of vLLM's processes (a general plugin): see `qwen2_vl_without_torchvision`."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from rl.patches.targets import patch_target

TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def qwen2_vl_without_torchvision() -> None:
    """A vLLM general plugin (pyproject.toml's `vllm.general_plugins` entry point). vLLM's Qwen3.5 module (every
    Qwen3.5 and 3.6 model, text-only ones included) imports Qwen3-VL's, which imports `smart_resize` from transformers'
    torchvision image processor for Qwen2-VL; that module imports torchvision unconditionally. The CPU stack has no
    torchvision (PyPI's, built for the CUDA torch, fails at import beside the CPU torch: docs/architecture.md), so
    without this vLLM cannot even inspect a Qwen3.5 checkpoint. Where torchvision is not installed, the module's name
    is bound to transformers' PIL image processor for Qwen2-VL, which defines the same `smart_resize` (a copy) and the
    PIL processor transformers itself falls back to; anything else imported from it fails as before, by name. Where
    torchvision is installed (GPU hosts) nothing changes."""
    if importlib.util.find_spec("torchvision") is not None or TORCHVISION_PROCESSOR in sys.modules:
        return
    sys.modules[TORCHVISION_PROCESSOR] = importlib.import_module(PIL_PROCESSOR)
    videos_refused_without_torchvision()



def videos_refused_without_torchvision() -> None:
    """Where torchvision is absent, a processor with a video processor (Qwen3-VL's, Qwen3.5's) loads with
    `NoVideos` in its place instead of failing: transformers' video processors are torchvision's (even
    `AutoVideoProcessor` is a placeholder without it), and vLLM loads the whole processor to serve images. Images are
    served; a video is refused by name when one is processed."""
    from transformers import processing_utils
    from transformers.video_processing_utils import VideoProcessorMixin

    loaders = patch_target(patch_target(processing_utils, "_LazyAutoProcessorMapping", "transformers"),
                           "_MAPPING_NAMES", "transformers")
    patch_target(processing_utils, "transformers_module", "transformers")
    loaders["video_processor"] = (__name__, "NoVideosLoader")
    # the processor checks its video processor against this name, which transformers exports only with torchvision
    setattr(processing_utils.transformers_module, "VideoProcessorMixin", VideoProcessorMixin)


class NoVideosLoader:
    """Stands in for `AutoVideoProcessor` in a processor's loading: a `NoVideos` with the checkpoint's video
    settings (merge and patch sizes, which processors read when they count tokens)."""

    @classmethod
    def from_pretrained(cls, name, *args, **kwargs):
        from transformers.video_processing_utils import BaseVideoProcessor

        class NoVideos(BaseVideoProcessor):
            def __call__(self, *args, **kwargs):
                raise RuntimeError("videos need torchvision, which this host lacks (the CPU stack has none): "
                                   "send images, or serve on a host with torchvision")

            preprocess = __call__

        settings, _ = BaseVideoProcessor.get_video_processor_dict(name, **kwargs)
        return NoVideos(**{key: value for key, value in settings.items() if not key.endswith("_type")})
