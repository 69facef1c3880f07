"""rl's change to transformers, in each of vLLM's processes (a general plugin): see `qwen2_vl_without_torchvision`."""

from __future__ import annotations

import importlib
import importlib.util
import sys

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
