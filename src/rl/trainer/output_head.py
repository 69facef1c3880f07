"""The output layer as the trainer needs it: per-token logprob and entropy, never a [tokens, vocab] tensor.

For hidden states h_t [H], the LM head weight W [V, H], temperature tau and the target token y_t:

    z_t        = (W h_t) / tau                       logits, computed in fp32 after the upcast (as vLLM)
    lse_t      = log sum_v exp(z_tv)
    logp_t     = z_t[y_t] - lse_t                    the token's logprob (with gradient)
    H_t        = lse_t - sum_v softmax(z_t)_v z_tv   entropy (no gradient: a metric)
    d logp_t / d z_t = onehot(y_t) - softmax(z_t),   so  dh_t = W^T dz_t / tau,  dW += dz_t h_t^T / tau

With soft targets (a teacher's top-k tokens j_1..j_k and their weights q_t1..q_tk, on-policy distillation's dense
term, trainer/loss.py), also their cross-entropy against the student (with gradient):

    ce_t       = -sum_i q_ti (z_t[j_i] - lse_t)
    d ce_t / d z_t = Q_t softmax(z_t) - sum_i q_ti onehot(j_i),   Q_t = sum_i q_ti

Both backward GEMMs run in the weight's dtype (bf16 under mixed precision: tensor cores); dW's per-chunk
partials are summed in an fp32 [V, H] buffer.

The forward walks the tokens in chunks of `chunk` rows and keeps only lse [N]; the backward recomputes each
chunk's logits. Peak memory is two [chunk, V] fp32 tensors (forward: z and softmax(z); backward: dz, formed in
place) instead of several [N, V] ones (Qwen3's V is 151,936: one fp32 [16k, V] tensor is ~10 GB).

`LogprobHead` replaces the model's `lm_head` (holding the same weight Parameter, so tied embeddings stay tied)
before the model is sharded, so it runs inside the model's own forward, where FSDP2 has gathered the weight.
While `targets` are set (`forward_logprobs` sets them), it returns [B, T, 3] (logprob, entropy, soft
cross-entropy) where the model would return logits; otherwise it is a plain linear head.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 1024


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], soft_ids [N, k], soft_weights [N, k], temperature, chunk) ->
    (logprobs [N], entropy [N], soft cross-entropy [N]), computed in fp32 (fp64 for fp64 inputs). k = 0: no soft
    targets (their cross-entropy is 0)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, soft_ids, soft_weights, temperature: float, chunk: int):
        n, compute = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(n, dtype=compute, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        soft_ce = torch.zeros_like(logprobs)
        soft_weights = soft_weights.to(compute)
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
            if soft_ids.shape[1]:
                soft_z = z.gather(-1, soft_ids[rows]) - lse[rows, None]  # [c, k] the soft targets' logprobs
                soft_ce[rows] = -(soft_weights[rows] * soft_z).sum(-1)
            del z, p  # before the next chunk's are allocated
        ctx.save_for_backward(hidden, weight, targets, soft_ids, soft_weights, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy, soft_ce

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, grad_soft_ce):
        hidden, weight, targets, soft_ids, soft_weights, lse = ctx.saved_tensors
        soft = soft_ids.shape[1] > 0 and grad_soft_ce is not None
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
            if soft:  # (g_ce Q - g) softmax(z) / tau
                g_soft = grad_soft_ce[rows, None].to(compute) / ctx.temperature  # [c, 1]
                scale = g_soft * soft_weights[rows].sum(-1, keepdim=True) - g
            else:
                scale = -g
            dz.sub_(lse[rows, None]).exp_().mul_(scale)  # in place: one [c, V] tensor
            dz.scatter_add_(-1, targets[rows, None], g)  # + g onehot(y) / tau
            if soft:
                dz.scatter_add_(-1, soft_ids[rows], -g_soft * soft_weights[rows])  # - g_ce sum_i q_i onehot(j_i) / tau
            if grad_hidden is not None:  # in the weight's dtype: no fp32 copy of the [V, H] weight
                grad_hidden[rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, dz, h)
            del dz
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


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
    logprobs, entropy, _ = chunked_scores(hidden, weight, targets, temperature, chunk)
    return logprobs, entropy


def chunked_scores(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK_TOKENS, soft: SoftTargets | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked_logprobs` and the cross-entropy of `soft` targets (0 without them); any leading shape."""
    lead, n = hidden.shape[:-1], targets.numel()
    ids = soft.ids.reshape(n, -1) if soft is not None else torch.zeros(n, 0, dtype=torch.long, device=targets.device)
    weights = soft.weights.reshape(n, -1) if soft is not None else torch.zeros(n, 0, device=targets.device)
    logprobs, entropy, soft_ce = ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                       targets.reshape(-1), ids, weights, temperature, chunk)
    return logprobs.reshape(lead), entropy.reshape(lead), soft_ce.reshape(lead)


@dataclass(frozen=True)
class SoftTargets:
    """Per position, k tokens and their weights (a teacher's top-k and its probabilities): [..., k] each."""

    ids: torch.Tensor
    weights: torch.Tensor

    def shifted(self) -> SoftTargets:
        """Aligned as the targets are: position t holds what token t + 1's prediction is scored against."""
        return SoftTargets(torch.roll(self.ids, -1, dims=1), torch.roll(self.weights, -1, dims=1))


class LogprobHead(torch.nn.Module):
    """A drop-in `lm_head` (same weight Parameter) that gives (logprob, entropy, soft cross-entropy) of set targets
    instead of logits."""

    def __init__(self, weight: torch.nn.Parameter, chunk: int):
        super().__init__()
        self.weight = weight
        self.chunk = chunk
        self.targets: torch.Tensor | None = None
        self.soft: SoftTargets | None = None
        self.temperature = 1.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight)
        scores = chunked_scores(hidden, self.weight, self.targets, self.temperature, self.chunk, self.soft)
        return torch.stack(scores, dim=-1)  # [B, T, 3] where logits would be

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, temperature: float, soft: SoftTargets | None = None):
        """While inside, the model's output `logits` are [B, T, 3]: logprob of `targets` [B, T], entropy, and the
        cross-entropy of `soft` targets (aligned as `targets`; 0 without them)."""
        self.targets, self.temperature, self.soft = targets, temperature, soft
        try:
            yield
        finally:
            self.targets, self.temperature, self.soft = None, 1.0, None


def install_logprob_head(model: torch.nn.Module, chunk: int) -> LogprobHead:
    """Replace the model's lm_head by a `LogprobHead` on the same weight; call before sharding."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias, which LogprobHead does not compute")
    new = LogprobHead(head.weight, chunk)
    model.set_output_embeddings(new)
    return new
