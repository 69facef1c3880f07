"""What a step must be to be served by this server, checked on the header of a step over the wire before any of it
is received (rl/inference/staging.py's `receive_weights`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl.inference.fingerprint import shape_mismatches
from rl.inference.reading import with_tied_shape
from rl.weights.header import Header


@dataclass(frozen=True)
class ServedLayout:
    """What a step must be to be served here, checked on its header before anything of it is received: every tensor
    in the served dtype; full weights with the served model's names and shapes (the tied head may be left out), or,
    on a LoRA server, an adapter: LoRA matrices, no larger in all than the served model."""

    dtype: torch.dtype
    shapes: dict[str, tuple[int, ...]]
    tied: bool
    adapters: bool

    def problem(self, header: Header) -> str | None:
        dtypes = sorted({str(dtype) for _, dtype, _ in header.tensors if dtype != self.dtype})
        if dtypes:
            return f"holds tensors of {', '.join(dtypes)}, but this server serves {self.dtype}"
        if not self.adapters:
            if header.adapter_config is not None:
                return "is a LoRA adapter, but this server serves full weights (it was started without inference.lora)"
            shapes = with_tied_shape({name: shape for name, _, shape in header.tensors}, self.tied)
            mismatched = shape_mismatches(self.shapes, shapes)
            return f"does not fit the served model: {'; '.join(mismatched[:5])}" if mismatched else None
        if header.adapter_config is None:
            return "holds full weights, but this server serves a LoRA adapter over a fixed base model"
        odd = [name for name, _, shape in header.tensors
               if not name.endswith((".lora_A.weight", ".lora_B.weight")) or len(shape) != 2]
        if odd:
            return f"names {odd[0]!r}, which is no LoRA matrix"
        served = self.dtype.itemsize * sum(math.prod(shape) for shape in self.shapes.values())
        if header.bytes > served:
            return f"holds {header.bytes} bytes of adapter, more than the served model's {served}"
        return None

    def rpc(self) -> dict:
        """As the server passes it to its first worker, which receives over NCCL."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "shapes": self.shapes, "tied": self.tied,
                "adapters": self.adapters}

    @classmethod
    def from_rpc(cls, layout: dict) -> ServedLayout:
        return cls(getattr(torch, layout["dtype"]), {name: tuple(shape) for name, shape in layout["shapes"].items()},
                   layout["tied"], layout["adapters"])
