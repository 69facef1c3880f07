"""The chunked output layer (trainer/output_head.py): equal to the naive fp64 computation in values and gradients,
temperature applied after the upcast, and nothing kept for backward larger than chunk x vocab."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rl.trainer.output_head import LogprobHead, TeacherTopK, chunked_logprobs, chunked_scores


def naive(hidden, weight, targets, temperature):
    """log_softmax over [N, V] in fp64: the reference."""
    z = hidden.double() @ weight.double().T / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_naive_fp64_computation(chunk, temperature):
    hidden, weight, targets = inputs()
    targets[7], targets[8] = 0, 49  # labels at a chunk edge (chunk 8) and at the vocabulary's edges
    grad_out = torch.randn(hidden.shape[0], dtype=torch.float64)
    logp, entropy = chunked_logprobs(hidden, weight, targets, temperature, chunk)
    (logp.double() * grad_out).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = naive(hidden, weight, targets, temperature)
    (ref_logp * grad_out).sum().backward()
    assert torch.allclose(logp.double(), ref_logp, atol=1e-6, rtol=0)
    assert torch.allclose(entropy.double(), ref_entropy.detach(), atol=1e-6, rtol=0)
    assert torch.allclose(got[0], hidden.grad, atol=1e-6, rtol=0)
    assert torch.allclose(got[1], weight.grad, atol=1e-6, rtol=0)
    assert not entropy.requires_grad  # a metric: no graph kept for it


def naive_top_k_kl(logp: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The reverse KL over the top k and the rest as one, from the student's full log_softmax [N, V]."""
    student = logp.gather(-1, ids)
    rest = (1 - student.exp().sum(-1)).clamp_min(1e-6)
    teacher_rest = (1 - teacher.exp().sum(-1)).clamp_min(1e-6)
    return (student.exp() * (student - teacher)).sum(-1) + rest * (rest.log() - teacher_rest.log())


@pytest.mark.parametrize("chunk", [1, 8, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_top_k_kl_and_its_gradient_equal_the_naive_fp64_computation(chunk, temperature):
    """A teacher's top 5 (distinct tokens, the vocabulary's edges and the sampled token among them at one position)
    scored beside the sampled tokens: the value and the gradient of any mix of it and the logprobs."""
    hidden, weight, targets = inputs()
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(50, generator=g)[:5] for _ in range(37)])
    ids[3] = torch.tensor([0, 49, 7, 8, targets[3]]) if targets[3] not in (0, 49, 7, 8) else ids[3]
    teacher = torch.log_softmax(2 * torch.randn(37, 50, generator=g, dtype=torch.float64), -1).gather(-1, ids)
    grad_logp, grad_kl = (torch.randn(37, generator=g, dtype=torch.float64) for _ in range(2))
    logp, _, kl = chunked_scores(hidden, weight, targets, temperature, chunk, TeacherTopK(ids, teacher))
    (logp.double() * grad_logp + kl.double() * grad_kl).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = torch.log_softmax(hidden @ weight.T / temperature, -1)
    ref_logp, ref_kl = reference.gather(-1, targets[:, None]).squeeze(-1), naive_top_k_kl(reference, ids, teacher)
    (ref_logp * grad_logp + ref_kl * grad_kl).sum().backward()
    assert (ref_kl > 0).all()
    assert torch.allclose(logp.double(), ref_logp, atol=1e-6, rtol=0)
    assert torch.allclose(kl.double(), ref_kl, atol=1e-6, rtol=0)
    assert torch.allclose(got[0], hidden.grad, atol=1e-6, rtol=0)
    assert torch.allclose(got[1], weight.grad, atol=1e-6, rtol=0)


def test_temperature_divides_after_the_upcast():
    """bf16 logits divided by T before the upcast round differently; vLLM upcasts first."""
    hidden, weight, targets = (t.detach() for t in inputs(v=2000))
    h, w = hidden.bfloat16(), weight.bfloat16()
    logp, _ = chunked_logprobs(h, w, targets, 0.7, 8)
    z = (h @ w.T).float() / 0.7  # upcast, then temperature
    expected = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(logp, expected, atol=1e-5)


def test_nothing_saved_for_backward_is_larger_than_a_chunk_of_logits():
    n, h, v, chunk = 300, 8, 1000, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(v, h))
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = chunked_logprobs(hidden, weight, torch.randint(0, v, (n,)), 1.0, chunk)
    logp.sum().backward()
    # the inputs themselves (hidden states and the head's weight, alive anyway) and [N]-sized vectors
    others = [t for t in saved if t.data_ptr() not in (hidden.data_ptr(), weight.data_ptr())]
    assert saved and all(t.numel() <= chunk * v for t in others), [tuple(t.shape) for t in others]
    assert all(t.numel() <= n for t in others)
    # the naive computation keeps [N, V] tensors: the audit can fail
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(hidden @ weight.T, -1).sum()
    assert max(t.numel() for t in saved) >= n * v


def test_the_head_is_a_plain_linear_layer_unless_scoring():
    weight = torch.nn.Parameter(torch.randn(10, 4))
    head = LogprobHead(weight, chunk=3)
    hidden = torch.randn(2, 5, 4)
    assert torch.equal(head(hidden), hidden @ weight.T)
    targets = torch.randint(0, 10, (2, 5))
    with head.scoring(targets, 0.5):
        scored = head(hidden)  # [B, T, 3]
    expected = torch.log_softmax(hidden @ weight.T / 0.5, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert scored.shape == (2, 5, 3) and torch.allclose(scored[..., 0], expected, atol=1e-5)
    assert torch.equal(scored[..., 2], torch.zeros(2, 5))  # no teacher: no top-k KL
    assert head.targets is None and head.teacher is None


def vllm_like(hidden, weight, targets, temperature):
    """What vLLM computes from bf16 weights: bf16 logits, upcast to fp32, then temperature and log_softmax."""
    z = (hidden @ weight.T).float() / temperature
    return torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1), z


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_chunked_logprobs_equal_vllms_computation_and_stay_within_bf16_rounding_of_fp32(device):
    """In bf16 the comparison is with what vLLM computes from the same bf16 weights (bf16 logits, fp32 softmax),
    not with an fp32 forward: bf16 logits are rounded to 8 significant bits, so against fp32 every logprob may be
    off by up to 2 * 2^-8 * max|z| / T (the target's logit and the log-sum-exp each move by at most one rounding
    of the largest logit). At Qwen3's vocabulary that is ~0.2 here; the old atol 1e-3 failed by construction."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 4096 if device == "cuda" else 256
    hidden, weight, targets = (t.detach() for t in inputs(n=n, h=64, v=151_936))
    h = hidden.to(device).bfloat16().requires_grad_()
    w = weight.to(device).bfloat16().requires_grad_()
    targets = targets.to(device)
    logp, _ = chunked_logprobs(h, w, targets, 0.7, 1024)
    logp.sum().backward()
    expected, z = vllm_like(h.detach(), w.detach(), targets, 0.7)
    # On CPU the chunked GEMMs round as the whole one does (seen: 7.6e-6); cuBLAS may pick another kernel per chunk
    # shape and round a logit one bf16 step (2^-7 of the largest) the other way.
    tolerance = 1e-4 if device == "cpu" else 2.0**-7 * z.abs().max().item()
    assert (logp.float() - expected).abs().max().item() <= tolerance
    fp32, _ = naive(h.detach().float(), w.detach().float(), targets, 0.7)
    bound = 2 * 2.0**-8 * z.abs().max().item()
    assert (logp.double() - fp32).abs().max().item() <= bound
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product whose output has `shape`."""

    MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.dtypes = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.MATMULS and tuple(out.shape) == self.shape:
            self.dtypes.append({a.dtype for a in args if isinstance(a, torch.Tensor) and a.ndim == 2})
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_weight_gradient_is_a_bf16_gemm_within_bf16_rounding_of_the_exact_one(device):
    """The output layer's weight gradient sum_t dz_t h_t^T in bf16: each chunk's GEMM takes bf16 operands (tensor
    cores on GPUs), its [V, H] partial is summed in fp32. Against the exact product of the same dz (fp32 softmax of
    the same bf16 logits) and h, each element may be off by three bf16 roundings (8 significant bits: 2^-8
    relative each) of the terms it sums: dz to bf16, each chunk's partial, the final gradient to the weight's
    dtype, so by at most 3 * 2^-8 * (|dZ|^T |H|) (seen on CPU: 2.7 * 2^-8); the bound is 4 * 2^-8 * (|dZ|^T |H|),
    with room for the GEMM's own fp32 sums."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, v, hid, chunk = (4096, 32_768, 256, 1024) if device == "cuda" else (300, 5000, 64, 128)
    hidden, weight, targets = (t.detach() for t in inputs(n=n, h=hid, v=v))
    h = hidden.to(device).bfloat16().requires_grad_()
    w = weight.to(device).bfloat16().requires_grad_()
    targets, grad_out = targets.to(device), torch.randn(n, device=device)
    logp, _ = chunked_logprobs(h, w, targets, 0.7, chunk)
    with MatmulDtypes((v, hid)) as matmuls:
        (logp * grad_out).sum().backward()
    assert matmuls.dtypes and all(d == {torch.bfloat16} for d in matmuls.dtypes), matmuls.dtypes
    assert w.grad.dtype == torch.bfloat16
    dz = []
    for start in range(0, n, chunk):  # the same chunk GEMMs as the layer: the same bf16 logits
        z = F.linear(h.detach()[start:start + chunk], w.detach()).float() / 0.7
        onehot = F.one_hot(targets[start:start + chunk], v).float()
        dz.append(grad_out[start:start + chunk, None] * (onehot - torch.softmax(z, -1)) / 0.7)
    dz, hh = torch.cat(dz).double(), h.detach().double()
    exact, scale = dz.T @ hh, dz.abs().T @ hh.abs()  # [V, H] each
    excess = (w.grad.double() - exact).abs() - 4 * 2.0**-8 * scale
    assert excess.max().item() <= 0, f"beyond the bound by {excess.max().item():.3g}"
