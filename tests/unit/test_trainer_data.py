"""Micro-batches: packing places samples without overlap, position ids restart per sample, and a packed
forward gives the same per-token logprobs as one forward per sample (no attention across samples)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.samples import Sample
from rl.trainer import attention
from rl.trainer.attention import PACKED_SDPA, packed_sdpa_attention, transformers_attention
from rl.trainer.config import TrainerConfig
from rl.trainer.data import (
    build_micro_batches, empty_micro_batch, pack_rows, packed_micro_batch, trained_tokens, truncate,
)
from rl.trainer.model import forward_logprobs, forward_scores, prepare_for_training
from rl.trainer.output_head import TeacherTopK, install_logprob_head


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The naive reference: log_softmax over [B, T, V], logprob of each next token, position 0 gets 0."""
    picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def scoring_model(model_dir, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    install_logprob_head(model, chunk=5)  # chunks smaller than the rows: their edges are crossed
    return model


def sample(ids: list[int], prompt: int, advantage: float = 1.0) -> Sample:
    mask = [0] * prompt + [1] * (len(ids) - prompt)
    return Sample(ids, mask, [-1.0 * m for m in mask], advantage, 0.0, 0)


def test_pack_rows_first_fit_longest_first():
    # lengths 5, 7, 3, 4 into rows of 10: 7 -> row 0 (3 left), 5 -> row 1 (5 left), 4 -> row 1, 3 -> row 0
    assert pack_rows([5, 7, 3, 4], 10) == [[1, 2], [0, 3]]
    assert pack_rows([10, 10], 10) == [[0], [1]]


def test_packed_row_layout():
    a, b = sample([5, 6, 7], prompt=1, advantage=2.0), sample([8, 9, 10, 11], prompt=2, advantage=-1.0)
    (mb,) = build_micro_batches([a, b], [0.5, 0.25], row_tokens=8, micro_batch_size=1, packing=True, pad_id=0)
    assert mb.attention_mask is None
    assert mb.input_ids.tolist() == [[8, 9, 10, 11, 5, 6, 7]]  # longest first
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.loss_mask.tolist() == [[False, False, True, True, False, True, True]]
    assert mb.advantages.tolist() == [[-1.0] * 4 + [2.0] * 3]
    assert mb.weights.tolist() == [[0.25] * 4 + [0.5] * 3]


def test_padding_fallback_and_empty_micro_batch():
    a, b = sample([5, 6, 7], prompt=1), sample([8, 9], prompt=1)
    (mb,) = build_micro_batches([a, b], [1.0, 1.0], row_tokens=8, micro_batch_size=2, packing=False, pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert mb.weights.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    for packing in (True, False):
        empty = empty_micro_batch(0, packing)
        assert not empty.loss_mask.any() and not empty.weights.any()


def test_truncation_and_trained_tokens():
    s = truncate(sample([1, 2, 3, 4, 5], prompt=2), 4)
    assert s.input_ids == [1, 2, 3, 4] and trained_tokens(s) == 2


def ranked(s: Sample, k: int = 3) -> Sample:
    """`s` with a made-up teacher top-k: at token t, tokens t + 1 .. t + k, their logprobs falling."""
    return Sample(s.input_ids, s.loss_mask, s.logprobs, s.advantage, s.reward, s.policy_version, s.logprobs,
                  [[t + i for i in range(1, k + 1)] for t in s.input_ids],
                  [[-1.0 * i for i in range(1, k + 1)] for _ in s.input_ids])


@pytest.mark.parametrize("packing", [True, False])
def test_the_teachers_top_k_scores_each_tokens_prediction_packed_or_padded_and_truncated(tiny_model, packing):
    """Position t's top-k is compared with the distribution that predicted token t (from tokens < t), as its logprob
    is, in packed rows and padded ones; truncation cuts the top-k with the tokens."""
    samples = [ranked(sample([5, 6, 7, 8, 9, 10, 11], 2)), ranked(sample([11, 12, 13], 1))]
    samples = [truncate(s, 6) for s in samples]
    assert len(samples[0].teacher_top_ids) == 6 and samples[0].teacher_top_ids[-1] == [11, 12, 13]
    (mb,) = build_micro_batches(samples, [1.0] * 2, row_tokens=16, micro_batch_size=2, packing=packing, pad_id=0)
    assert mb.teacher_top_ids.shape == mb.teacher_top_logprobs.shape == (*mb.input_ids.shape, 3)
    model = scoring_model(tiny_model)
    with torch.no_grad():
        logprobs, _, kl = forward_scores(model, mb, 1.0, TeacherTopK(mb.teacher_top_ids, mb.teacher_top_logprobs))
        for row, s in enumerate(samples if not packing else [None]):
            for i, one in enumerate([s] if s is not None else samples):
                ids = torch.tensor([one.input_ids])
                naive = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]  # [T, V]: predicts t + 1
                start = 0 if not packing else sum(len(x.input_ids) for x in samples[:i])
                for t in range(1, len(one.input_ids)):
                    student = naive[t - 1, one.teacher_top_ids[t]]
                    teacher = torch.tensor(one.teacher_top_logprobs[t])
                    rest, teacher_rest = 1 - student.exp().sum(), 1 - teacher.exp().sum()
                    expected = (student.exp() * (student - teacher)).sum() + rest * (rest / teacher_rest).log()
                    assert torch.allclose(kl[row, start + t], expected, atol=1e-5), (one.input_ids, t)
                    assert torch.allclose(logprobs[row, start + t], naive[t - 1, one.input_ids[t]], atol=1e-5)


@pytest.mark.parametrize(
    "kernel", ["sdpa", PACKED_SDPA, "eager", pytest.param("flex_attention", marks=pytest.mark.gpu)]
)
def test_packed_forward_matches_separate_forwards(tiny_model, kernel):
    device = torch.device("cuda" if kernel == "flex_attention" else "cpu")
    model = scoring_model(tiny_model, attn_implementation=kernel)
    model.to(device)
    samples = [sample([5, 6, 7, 8, 9, 10], 2), sample([11, 12, 13], 1), sample([14, 15, 16, 17], 1)]
    (packed,) = build_micro_batches(samples, [1.0] * 3, row_tokens=16, micro_batch_size=1, packing=True, pad_id=0)
    packed = packed.to(device)
    with torch.no_grad():
        packed_lp, _ = forward_logprobs(model, packed)  # [1, 13]
        order = sorted(samples, key=lambda s: -len(s.input_ids))
        ids = [torch.tensor([s.input_ids], device=device) for s in order]
        separate = [token_logprobs(model(input_ids=i).logits, i) for i in ids]
    expected = torch.cat(separate, 1)  # [1, 13]
    mask = packed.loss_mask
    assert torch.allclose(packed_lp[mask], expected[mask], atol=1e-5)
    # without restarting positions (one long sample) the logprobs differ: the test can fail
    with torch.no_grad():
        joined = token_logprobs(model(input_ids=packed.input_ids).logits, packed.input_ids)
    assert not torch.allclose(joined[mask], expected[mask], atol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rl_sdpa_attends_each_packed_sample_without_the_mask(tiny_model, monkeypatch, device):
    """Logprobs and gradients of a packed row are transformers' masked sdpa's, computed one sample at a time."""
    samples = [sample([5, 6, 7, 8, 9, 10], 2), sample([11, 12, 13], 1), sample([14, 15, 16, 17], 1)]
    (mb,) = build_micro_batches(samples, [1.0] * 3, row_tokens=16, micro_batch_size=1, packing=True, pad_id=0)
    assert mb.sample_lengths == (6, 4, 3)
    mb = mb.to(torch.device(device))
    ours = scoring_model(tiny_model, attn_implementation=PACKED_SDPA).to(device)
    masked = scoring_model(tiny_model).to(device)
    expected, _ = forward_logprobs(masked, mb)
    expected[mb.loss_mask].sum().backward()

    def masked_path(*args, **kwargs):
        raise AssertionError("a packed row with its lengths reached the masked sdpa")

    monkeypatch.setattr(attention, "sdpa_attention_forward", masked_path)
    got, _ = forward_logprobs(ours, mb)
    got[mb.loss_mask].sum().backward()
    tolerance = 1e-5 if device == "cpu" else 1e-4  # CUDA's kernels differ more from one another
    assert torch.allclose(got[mb.loss_mask], expected[mb.loss_mask], atol=tolerance)
    for (name, p), (_, q) in zip(ours.named_parameters(), masked.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=tolerance), name


def test_rl_sdpa_refuses_lengths_that_do_not_fill_the_row():
    q = torch.zeros(1, 2, 7, 32)
    with pytest.raises(ValueError, match=r"sample_lengths \[4, 2\] \(sum 6\) do not describe one packed row of 7"):
        packed_sdpa_attention(None, q, q, q, None, sample_lengths=(4, 2))


def test_rl_sdpa_serves_sdpa_on_cpu_without_compile():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert transformers_attention("sdpa", compile_blocks=False, device=cpu) == PACKED_SDPA
    assert transformers_attention("sdpa", compile_blocks=False, device=cuda) == "sdpa"
    assert transformers_attention("sdpa", compile_blocks=True, device=cpu) == "sdpa"
    assert transformers_attention("eager", compile_blocks=False, device=cpu) == "eager"


def test_logprobs_follow_the_sampling_temperature(tiny_model):
    """vLLM reports logprobs of logits / T; the trainer's must be of the same distribution."""
    model = scoring_model(tiny_model)
    (mb,) = build_micro_batches([sample([5, 6, 7, 8, 9], 2)], [1.0], row_tokens=16, micro_batch_size=1, packing=True,
                                pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids).logits
        tempered, _ = forward_logprobs(model, mb, temperature=0.5)
        plain, _ = forward_logprobs(model, mb)
    expected = torch.log_softmax(logits[0, :-1] / 0.5, -1).gather(-1, mb.input_ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(tempered[0, 1:], expected, atol=1e-5)
    assert not torch.allclose(plain[0, 1:], expected, atol=1e-3)


def test_micro_batch_tokens_packs_more_samples_per_pass():
    samples = [sample([5] * 6, 2) for _ in range(8)]
    by_seq_len = build_micro_batches(samples, [1.0] * 8, row_tokens=12, micro_batch_size=1, packing=True, pad_id=0)
    by_tokens = build_micro_batches(samples, [1.0] * 8, row_tokens=48, micro_batch_size=1, packing=True, pad_id=0)
    assert [mb.input_ids.shape[1] for mb in by_seq_len] == [12] * 4
    assert [mb.input_ids.shape[1] for mb in by_tokens] == [48]


def test_micro_batch_tokens_holds_at_least_one_longest_sample():
    assert TrainerConfig(seq_len=128, micro_batch_tokens=64).row_tokens == 128
    assert TrainerConfig(seq_len=128).row_tokens == 128
    assert TrainerConfig(seq_len=128, micro_batch_tokens=1024).row_tokens == 1024


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_checkpointing_recomputes_blocks_in_backward(tiny_model, checkpointing):
    model = prepare_for_training(scoring_model(tiny_model), checkpointing)
    assert model.training  # from_pretrained gives eval mode, where transformers never recomputes
    calls = []
    # a pre-hook: recomputation stops as soon as the last saved tensor is back, before forward hooks
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    mb = packed_micro_batch([Sample(list(range(4, 20)), [1] * 16, [0.0] * 16, 1.0, 0.0, 0)], [1.0])
    logprobs, _ = forward_logprobs(model, mb)
    logprobs.sum().backward()
    assert len(calls) == (2 if checkpointing else 1)


@pytest.mark.parametrize("pad, eos, filler", [(3, 7, 3), (None, 7, 7), (None, None, 0)])
def test_filler_token_without_a_pad_token(pad, eos, filler):
    """Llama-3 and others have no pad token: rows are padded and empty micro-batches filled with eos, else 0,
    never None (which torch.tensor refuses); masked either way."""
    from types import SimpleNamespace

    from rl.trainer.data import filler_token_id

    tokenizer = SimpleNamespace(pad_token_id=pad, eos_token_id=eos)
    assert filler_token_id(tokenizer) == filler
    for packing in (True, False):
        empty = empty_micro_batch(filler_token_id(tokenizer), packing)
        assert empty.input_ids.unique().tolist() == [filler]
        assert not empty.loss_mask.any() and not empty.weights.any()
    a, b = sample([5, 6, 7], prompt=1), sample([8, 9], prompt=1)
    (mb,) = build_micro_batches(
        [a, b], [1.0, 1.0], row_tokens=8, micro_batch_size=2, packing=False, pad_id=filler_token_id(tokenizer)
    )
    assert mb.input_ids.tolist() == [[5, 6, 7], [8, 9, filler]]
    assert not mb.loss_mask[1, 2] and mb.attention_mask[1, 2] == 0


def test_filler_token_of_a_tokenizer_without_pad_token_is_eos():
    from rl.tiny_model import build_tokenizer
    from rl.trainer.data import filler_token_id

    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert filler_token_id(tokenizer) == tokenizer.eos_token_id
