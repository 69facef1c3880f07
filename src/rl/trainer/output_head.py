"""The output layer as the trainer needs it: per-token logprob and entropy, never a [tokens, vocab] tensor.

For hidden states h_t [H], the LM head weight W [V, H], temperature tau and the target token y_t:

    z_t        = (W h_t) / tau                       logits, computed in fp32 after the upcast (as vLLM)
    lse_t      = log sum_v exp(z_tv)
    logp_t     = z_t[y_t] - lse_t                    the token's logprob (with gradient)
    H_t        = lse_t - sum_v softmax(z_t)_v z_tv   entropy (no gradient: a metric)
    d logp_t / d z_t = onehot(y_t) - softmax(z_t),   so  dh_t = W^T dz_t / tau,  dW += dz_t h_t^T / tau

With a teacher's top-k (tokens S_t = j_1..j_k and their logprobs log p_t(j), on-policy distillation's dense term,
trainer/loss.py), also the reverse KL from the student to the teacher over k + 1 outcomes, the k tokens and the
rest as one (with gradient; pi = softmax(z_t), rest_t = 1 - sum_S pi, the same for p):

    D_t        = sum_{j in S} pi_j (log pi_j - log p_j) + pi_rest (log pi_rest - log p_rest)
    d D_t / d z_tv = pi_v (a_v - D_t),   a_v = log pi_v - log p_v for v in S, log pi_rest - log p_rest elsewhere

(both rests floored at TAIL_FLOOR: 1 - sum is exact to ~1e-7 in fp32).

Both backward GEMMs run in the weight's dtype (bf16 under mixed precision: tensor cores); dW's per-chunk
partials are summed in an fp32 [V, H] buffer.

The forward walks the tokens in chunks of `chunk` rows and keeps only lse [N]; the backward recomputes each
chunk's logits. Peak memory is two [chunk, V] fp32 tensors (forward: z and softmax(z); backward: dz, formed in
place) instead of several [N, V] ones (Qwen3's V is 151,936: one fp32 [16k, V] tensor is ~10 GB).

`LogprobHead` replaces the model's `lm_head` (holding the same weight Parameter, so tied embeddings stay tied)
before the model is sharded, so it runs inside the model's own forward, where FSDP2 has gathered the weight.
While `targets` are set (`forward_logprobs` sets them), it returns [B, T, 3] (logprob, entropy, top-k KL)
where the model would return logits; otherwise it is a plain linear head.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 1024
TAIL_FLOOR = 1e-6  # the least probability the tokens outside a teacher's top-k count for, student's and teacher's


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], top_ids [N, k], top_logprobs [N, k], temperature, chunk) ->
    (logprobs [N], entropy [N], top-k KL [N]), computed in fp32 (fp64 for fp64 inputs). k = 0: no teacher top-k
    (the KL is 0)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, top_ids, top_logprobs, temperature: float, chunk: int):
        n, compute = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(n, dtype=compute, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        top_k_kl = torch.zeros_like(logprobs)
        top_logprobs = top_logprobs.to(compute)
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
            if top_ids.shape[1]:
                student = z.gather(-1, top_ids[rows]) - lse[rows, None]  # [c, k]
                top_k_kl[rows] = TopKKL(student, top_logprobs[rows]).value.squeeze(-1)
            del z, p  # before the next chunk's are allocated
        ctx.save_for_backward(hidden, weight, targets, top_ids, top_logprobs, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy, top_k_kl

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, grad_top_k_kl):
        hidden, weight, targets, top_ids, top_logprobs, lse = ctx.saved_tensors
        teacher = top_ids.shape[1] > 0
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
            scale = -g  # -g softmax(z) / tau
            if teacher:  # + g_D softmax(z) (a_rest - D) / tau
                g_kl = grad_top_k_kl[rows, None].to(compute) / ctx.temperature  # [c, 1]
                kl = TopKKL(dz.gather(-1, top_ids[rows]) - lse[rows, None], top_logprobs[rows])
                scale = scale + g_kl * (kl.rest_advantage - kl.value)
            dz.sub_(lse[rows, None]).exp_().mul_(scale)  # in place: one [c, V] tensor
            dz.scatter_add_(-1, targets[rows, None], g)  # + g onehot(y) / tau
            if teacher:  # + g_D pi_j (a_j - a_rest) / tau on the top k: their a_j in place of a_rest
                dz.scatter_add_(-1, top_ids[rows], g_kl * kl.student.exp() * (kl.advantage - kl.rest_advantage))
            if grad_hidden is not None:  # in the weight's dtype: no fp32 copy of the [V, H] weight
                grad_hidden[rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, dz, h)
            del dz
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class TopKKL:
    """D_t of the module docstring for rows of the student's and the teacher's logprobs of the top k ([c, k] each):
    `value` [c, 1], and the per-outcome terms of its gradient, `advantage` a_j [c, k] and `rest_advantage` [c, 1]."""

    def __init__(self, student: torch.Tensor, teacher: torch.Tensor):
        self.student = student
        student_rest = (1 - student.exp().sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)
        teacher_rest = (1 - teacher.exp().sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)
        self.advantage = student - teacher
        self.rest_advantage = student_rest.log() - teacher_rest.log()
        self.value = (student.exp() * self.advantage).sum(-1, keepdim=True) + student_rest * self.rest_advantage


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
                   chunk: int = DEFAULT_CHUNK_TOKENS, teacher: TeacherTopK | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked_logprobs` and the KL to the `teacher`'s top-k (0 without one); any leading shape."""
    lead, n = hidden.shape[:-1], targets.numel()
    none = torch.zeros(n, 0, dtype=torch.long, device=targets.device)
    ids = teacher.ids.reshape(n, -1) if teacher is not None else none
    top_logprobs = teacher.logprobs.reshape(n, -1) if teacher is not None else none.float()
    logprobs, entropy, top_k_kl = ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                        targets.reshape(-1), ids, top_logprobs, temperature, chunk)
    return logprobs.reshape(lead), entropy.reshape(lead), top_k_kl.reshape(lead)


@dataclass(frozen=True)
class TeacherTopK:
    """Per position, a teacher's k likeliest tokens (distinct) and its logprobs of them: [..., k] each."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def shifted(self) -> TeacherTopK:
        """Aligned as the targets are: position t holds what token t + 1's prediction is scored against."""
        return TeacherTopK(torch.roll(self.ids, -1, dims=1), torch.roll(self.logprobs, -1, dims=1))


class LogprobHead(torch.nn.Module):
    """A drop-in `lm_head` (same weight Parameter) that gives (logprob, entropy, top-k KL) of set targets instead of
    logits."""

    def __init__(self, weight: torch.nn.Parameter, chunk: int):
        super().__init__()
        self.weight = weight
        self.chunk = chunk
        self.targets: torch.Tensor | None = None
        self.teacher: TeacherTopK | None = None
        self.temperature = 1.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight)
        scores = chunked_scores(hidden, self.weight, self.targets, self.temperature, self.chunk, self.teacher)
        return torch.stack(scores, dim=-1)  # [B, T, 3] where logits would be

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, temperature: float, teacher: TeacherTopK | None = None):
        """While inside, the model's output `logits` are [B, T, 3]: logprob of `targets` [B, T], entropy, and the
        KL to the `teacher`'s top-k (aligned as `targets`; 0 without one)."""
        self.targets, self.temperature, self.teacher = targets, temperature, teacher
        try:
            yield
        finally:
            self.targets, self.temperature, self.teacher = None, 1.0, None


def install_logprob_head(model: torch.nn.Module, chunk: int) -> LogprobHead:
    """Replace the model's lm_head by a `LogprobHead` on the same weight; call before sharding."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias, which LogprobHead does not compute")
    new = LogprobHead(head.weight, chunk)
    model.set_output_embeddings(new)
    return new
