"""The output layer as the trainer needs it: per-token logprob and entropy, never a [tokens, vocab] tensor.

For hidden states h_t [H], the LM head weight W [V, H], temperature tau and the target token y_t:

    z_t        = (W h_t) / tau                       logits, computed in fp32 after the upcast (as vLLM)
    lse_t      = log sum_v exp(z_tv)
    logp_t     = z_t[y_t] - lse_t                    the token's logprob (with gradient)
    H_t        = lse_t - sum_v softmax(z_t)_v z_tv   entropy (no gradient: a metric)
    d logp_t / d z_t = onehot(y_t) - softmax(z_t),   so  dh_t = W^T dz_t / tau,  dW += dz_t h_t^T / tau

Both backward GEMMs run in the weight's dtype (bf16 under mixed precision: tensor cores); dW's per-chunk
partials are summed in an fp32 [V, H] buffer.

The forward walks the tokens in chunks of `chunk` rows and keeps only lse [N]; the backward recomputes each
chunk's logits. Peak memory is two [chunk, V] fp32 tensors (forward: z and softmax(z); backward: dz, formed in
place) instead of several [N, V] ones (Qwen3's V is 151,936: one fp32 [16k, V] tensor is ~10 GB).

`LogprobHead` replaces the model's `lm_head` (holding the same weight Parameter, so tied embeddings stay tied)
before the model is sharded, so it runs inside the model's own forward, where FSDP2 has gathered the weight.
While `targets` are set (`forward_logprobs` sets them), it returns [B, T, 2] (logprob, entropy) where the
model would return logits; otherwise it is a plain linear head.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 1024


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], temperature, chunk) -> (logprobs [N], entropy [N]), computed in
    fp32 (fp64 for fp64 inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        n, compute = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(n, dtype=compute, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            z = chunk_logits(hidden[rows], weight, compute, temperature)  # [c, V]
            peak = z.amax(-1, keepdim=True)  # [c, 1]
            p = torch.sub(z, peak).exp_()  # [c, V], softmax(z) once normalised
            total = p.sum(-1, keepdim=True)  # [c, 1]
            lse[rows] = (peak + total.log()).squeeze(-1)
            p.div_(total)
            logprobs[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            # sum_v p_v z_v as a batched dot product: no third [c, V] tensor
            entropy[rows] = lse[rows] - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
            del z, p  # before the next chunk's are allocated
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        compute = lse.dtype
        grad_weight = (
            torch.zeros(weight.shape, dtype=compute, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows]
            g = grad_logprobs[rows, None].to(compute) / ctx.temperature  # [c, 1]
            dz = chunk_logits(h, weight, compute, ctx.temperature)  # [c, V], recomputed
            dz.sub_(lse[rows, None]).exp_().mul_(-g)  # -g softmax(z) / tau, in place: one [c, V] tensor
            dz.scatter_add_(-1, targets[rows, None], g)  # + g onehot(y) / tau
            if grad_hidden is not None:  # in the weight's dtype: no fp32 copy of the [V, H] weight
                grad_hidden[rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, dz, h)
            del dz
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def accumulate_weight_grad(grad_weight: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight [V, H] += dz^T [V, c] @ h [c, H]. The GEMM runs in h's dtype: in bf16 on tensor cores (fp32
    accumulation inside the GEMM, one bf16 rounding of each chunk's [V, H] partial), not as an fp32 GEMM
    outside them; the partials add up in the fp32 buffer. For fp32 and fp64 inputs, one addmm as before."""
    if h.dtype == grad_weight.dtype:
        grad_weight.addmm_(dz.T, h)
    else:
        grad_weight += dz.to(h.dtype).T @ h  # the bf16 [V, H] partial: no more memory than the final downcast


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, compute: torch.dtype, temperature: float) -> torch.Tensor:
    """(hidden [c, H] @ weight^T) upcast to `compute`, then / temperature (after the upcast, as vLLM): [c, V]. In
    place where the matmul already gives `compute`, so a chunk costs one [c, V] tensor, not two."""
    z = F.linear(hidden, weight)
    return (z if z.dtype == compute else z.to(compute)).div_(temperature)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     chunk: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `targets` and entropy under softmax((hidden @ weight^T) / temperature); any leading shape."""
    lead = hidden.shape[:-1]
    logprobs, entropy = ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                              temperature, chunk)
    return logprobs.reshape(lead), entropy.reshape(lead)


class LogprobHead(torch.nn.Module):
    """A drop-in `lm_head` (same weight Parameter) that gives (logprob, entropy) of set targets instead of logits."""

    def __init__(self, weight: torch.nn.Parameter, chunk: int):
        super().__init__()
        self.weight = weight
        self.chunk = chunk
        self.targets: torch.Tensor | None = None
        self.temperature = 1.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight)
        logprobs, entropy = chunked_logprobs(hidden, self.weight, self.targets, self.temperature, self.chunk)
        return torch.stack([logprobs, entropy], dim=-1)  # [B, T, 2] where logits would be

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, temperature: float):
        """While inside, the model's output `logits` are [B, T, 2]: logprob of `targets` [B, T] and entropy."""
        self.targets, self.temperature = targets, temperature
        try:
            yield
        finally:
            self.targets, self.temperature = None, 1.0


def install_logprob_head(model: torch.nn.Module, chunk: int) -> LogprobHead:
    """Replace the model's lm_head by a `LogprobHead` on the same weight; call before sharding."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias, which LogprobHead does not compute")
    new = LogprobHead(head.weight, chunk)
    model.set_output_embeddings(new)
    return new
