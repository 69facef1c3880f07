"""Model FLOPs of a training step, for model FLOPs utilisation (MFU).

For a decoder with N matmul parameters (every parameter except the input embedding, plus the output head),
L layers and hidden size d, a sample of T tokens costs, forward and backward (PaLM appendix B):

    6 N T              the weight matmuls (2 N T forward, 4 N T backward)
    12 L d T^2         attention scores and values over the sample (causal masking not discounted)

Of the N, F frozen parameters (LoRA's base model) have no weight gradient: 4 F T instead of 6 F T.

Activation recomputation is not counted (model FLOPs, not hardware FLOPs). MFU = FLOPs / (seconds * peak).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per GPU, FLOP/s, by part (NVIDIA's data sheets: their "with sparsity" figures halved).
# Checked in order: the first part whose every word is in the device's name (upper-cased) wins.
PEAK_BF16_FLOPS = [
    (("B200",), 2250e12, "B200"),
    (("H200", "NVL"), 835e12, "H200 NVL"),
    (("H200",), 989e12, "H200 SXM"),
    (("H100", "NVL"), 835e12, "H100 NVL"),
    (("H100", "PCIE"), 756e12, "H100 PCIe"),
    (("H100",), 989e12, "H100 SXM"),
    (("A100",), 312e12, "A100 (40 and 80 GB, SXM and PCIe)"),
    (("L40S",), 362e12, "L40S"),
    (("A10G",), 125e12, "A10G"),
]
H100_PCIE_SMS = 114  # an H100 whose name omits its form factor: the PCIe part has 114 SMs, SXM and NVL 132


def matmul_params(model: torch.nn.Module) -> int:
    """N above: parameters that take part in matmuls (a tied head counts once, as the head)."""
    total = sum(p.numel() for p in model.parameters())  # unique parameters; global sizes for FSDP's DTensors
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total - embedding.numel() + (head.numel() if head is embedding else 0)


def frozen_matmul_params(model: torch.nn.Module) -> int:
    """F above: the frozen ones among the matmul parameters (none without LoRA)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if not embedding.requires_grad and head is not embedding:
        frozen -= embedding.numel()  # a lookup, not a matmul (a tied head counts, once, as the head)
    return frozen


def train_flops(n_params: int, layers: int, hidden: int, lengths: list[int], frozen: int = 0) -> float:
    """Forward and backward FLOPs of samples with these token counts."""
    return sum((6 * n_params - 2 * frozen) * t + 12 * layers * hidden * t * t for t in lengths)


def peak_flops(device: torch.device) -> tuple[float, str] | None:
    """The device's dense bf16 peak and the part it was taken for (from its name and SM count), or None where
    unknown (CPUs, GPUs not in the table)."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    name = properties.name.upper().replace("-", " ")
    unnamed_form = "H100" in name and "PCIE" not in name and "NVL" not in name
    if unnamed_form and properties.multi_processor_count == H100_PCIE_SMS:
        name += " PCIE"
    for words, peak, part in PEAK_BF16_FLOPS:
        if all(word in name for word in words):
            return peak, part
    return None
