"""The trainer's mixture-of-experts (trainer/moe.py) on the tiny Qwen3-MoE: the routed block computes what
transformers' fused block computes, under the checkpoint's names (so loading and publishing need no conversion);
router replay routes every token to the recorded experts; a batch whose experts do not fit is refused naming the
sample; the router's metrics and auxiliary loss."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rl.config import ModelConfig
from rl.samples import Sample, decode_samples, encode_samples
from rl.tiny_model import build_tiny_model
from rl.trainer.config import TrainerConfig
from rl.trainer.loss_config import LossConfig
from rl.trainer.data import build_micro_batches
from rl.trainer.model import forward_logprobs, load_policy
from rl.trainer.moe import RoutedExperts, moe_blocks
from rl.trainer.optim import build_optimizer, build_scheduler
from rl.trainer.step import train_step
from rl.trainer.weights import gather_shards

LAYERS, EXPERTS, TOP_K = 4, 8, 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")


def policy_of(moe_model, world, **loss):
    config = TrainerConfig(model=ModelConfig(name=str(moe_model)), seq_len=64, loss=LossConfig(**loss))
    return config, load_policy(config, world)


def samples(count: int, seed: int, routed: bool = True) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randrange(12, 24)
        mask = [0] * 4 + [1] * (n - 4)
        experts = torch.tensor([[rng.sample(range(EXPERTS), TOP_K) for _ in range(LAYERS)] for _ in range(n)],
                               dtype=torch.int16) if routed else None
        out.append(Sample([rng.randrange(5, 100) for _ in range(n)], mask, [-1.0 * m for m in mask],
                          rng.uniform(-1, 1), 0.0, 0, routed_experts=experts))
    return out


def recording_choices(model) -> list[list[torch.Tensor]]:
    """Each MoE block's chosen experts, [N, k] per forward, appended as the blocks choose them."""
    seen = [[] for _ in moe_blocks(model)]
    for i, block in enumerate(moe_blocks(model)):
        original = block.choose

        def choose(own, original=original, i=i):
            chosen = original(own)
            seen[i].append(chosen.clone())
            return chosen

        block.choose = choose
    return seen


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])  # Qwen3.5: a gated shared expert, linear attention
def test_the_routed_block_computes_what_transformers_computes_under_the_checkpoint_names(arch, tmp_path, world):
    moe_model = build_tiny_model(tmp_path / arch, arch=arch)
    _, policy = policy_of(moe_model, world)
    assert len(moe_blocks(policy)) == LAYERS and all(isinstance(b, RoutedExperts) for b in moe_blocks(policy))
    with safe_open(str(moe_model / "model.safetensors"), "pt") as f:
        files = set(f.keys())
    assert set(policy.state_dict()) == files | {"lm_head.weight"}  # the files lack the tied head
    published = gather_shards(policy, torch.float32, world, 2**30)
    assert set(published.weight_map) == files | {"lm_head.weight"}  # what vLLM reads, experts one by one
    reference = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    ids = torch.randint(5, 100, (1, 20))
    mb = build_micro_batches([Sample(ids[0].tolist(), [1] * 20, [0.0] * 20, 0.0, 0.0, 0)], [1.0], 64, 1, True, 0)[0]
    with torch.no_grad():
        ours, _ = forward_logprobs(policy, mb)
        logits = reference(input_ids=ids).logits.log_softmax(-1)
    theirs = torch.cat([torch.zeros(1, 1), logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]], 1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_replay_routes_every_token_to_the_recorded_experts(moe_model, world):
    _, policy = policy_of(moe_model, world)
    batch = samples(1, seed=1)
    recorded = batch[0].routed_experts.long()  # [T, L, k], unlike what the router would choose
    recorded[-1] = -1  # the sample's last token: never fed to inference's model, so not recorded
    batch[0].routed_experts = recorded.to(torch.int16)
    seen = recording_choices(policy)
    mb = build_micro_batches(batch, [1.0], 64, 1, True, 0)[0]
    with torch.no_grad():
        forward_logprobs(policy, mb)
        own = [s[-1] for s in seen]
    for layer in range(LAYERS):
        assert torch.equal(own[layer][:-1], recorded[:-1, layer])  # token for token, layer for layer
    mb.routed_experts = None  # the router's own choice
    with torch.no_grad():
        forward_logprobs(policy, mb)
    assert any(not torch.equal(s[-1][:-1], recorded[:-1, i]) for i, s in enumerate(seen))
    # the unrecorded token: the router's own choice (equal in the first layer; later ones see other hidden states)
    assert torch.equal(seen[0][-1][-1], seen[0][-2][-1])


def test_the_batch_file_carries_the_routed_experts(moe_model):
    batch = samples(3, seed=2)
    back = decode_samples(encode_samples(batch))
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(batch, back))
    with pytest.raises(ValueError, match="1 of 2 samples lack the routed experts"):
        encode_samples([batch[0], samples(1, 3, routed=False)[0]])


@pytest.mark.parametrize("fault, message", [
    (lambda r: r[:, :3], r"sample 1: recorded experts of shape \[\d+, 3, 2\], the model routes \[tokens, 4 layers"),
    (lambda r: r.clamp(max=EXPERTS), "sample 1: a recorded expert id out of range .*max 8; the model has 8 experts"),
    (lambda r: torch.cat([r[:2], r[2:3, :, :1].expand(1, -1, 2), r[3:]]) - 1,
     r"sample 1: token 2's recorded experts in layer 0 repeat one \(\[(\d), \1\]\); a token is routed to 2 distinct"),
])
def test_recorded_experts_that_do_not_fit_the_model_are_refused_naming_the_sample(moe_model, world, fault, message):
    config, policy = policy_of(moe_model, world)
    batch = samples(2, seed=4)
    batch[1].routed_experts = fault(batch[1].routed_experts + 1)
    optimizer = build_optimizer(policy, config.optim)
    with pytest.raises(ValueError, match=message):
        train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), batch, config, world, 0)


def test_a_batch_without_routed_experts_is_refused_while_replay_is_on(moe_model, world):
    config, policy = policy_of(moe_model, world)
    optimizer = build_optimizer(policy, config.optim)
    with pytest.raises(ValueError, match="sample 0 of the batch carries no routed experts.*router_replay"):
        train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), samples(2, 5, False),
                   config, world, 0)


def test_a_step_reports_the_router_and_the_aux_loss_trains_the_router_only_when_asked(moe_model, world):
    def gate_moved(coef: float) -> tuple[dict, float]:
        config, policy = policy_of(moe_model, world, router_aux_loss_coef=coef)
        optimizer = build_optimizer(policy, config.optim)
        gate = moe_blocks(policy)[0].gate.weight
        before = gate.detach().full_tensor().clone()
        batch = samples(4, seed=6)
        for s in batch:
            s.advantage = 0.0  # no policy gradient (and no weight decay): only the aux loss can move the router
        stats = train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), batch, config,
                           world, 0)
        return stats, float((gate.detach().full_tensor() - before).abs().max())

    stats, moved = gate_moved(0.0)
    assert 0 <= stats["moe/router_agreement"] < 0.5  # random records: the router's own choice is seldom the same
    assert stats["moe/routed_as_recorded"] == 1.0  # replayed: every recorded token-layer went where inference sent it
    assert 0 < stats["moe/router_entropy"] <= torch.log(torch.tensor(float(EXPERTS)))
    assert 1 / EXPERTS <= stats["moe/max_expert_share"] <= 1 and stats["moe/aux_loss"] > 0
    assert moved == 0
    _, moved = gate_moved(0.1)
    assert moved > 0


def test_the_router_agrees_with_a_record_of_its_own_routing(moe_model, world):
    """Recorded experts that are the trainer's own routing of the same tokens (what inference records in float32)
    agree everywhere: the record is aligned with the tokens it belongs to."""
    config, policy = policy_of(moe_model, world)
    batch = samples(2, seed=7, routed=False)
    seen = recording_choices(policy)
    for sample in batch:
        mb = build_micro_batches([sample], [1.0], 64, 1, True, 0)[0]
        with torch.no_grad():
            forward_logprobs(policy, mb)
        sample.routed_experts = torch.stack([s[-1] for s in seen], 1).to(torch.int16)  # [T, L, k]
    optimizer = build_optimizer(policy, config.optim)
    stats = train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), batch, config, world, 0)
    assert stats["moe/router_agreement"] == 1.0


def test_without_replay_the_record_is_only_compared_with_the_routing(moe_model, world):
    config, policy = policy_of(moe_model, world, router_replay=False)
    optimizer = build_optimizer(policy, config.optim)
    stats = train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), samples(3, seed=8),
                       config, world, 0)
    assert stats["moe/routed_as_recorded"] == stats["moe/router_agreement"] < 0.5
    unrecorded = samples(2, seed=9, routed=False)  # a dense-like batch: no record, nothing refused
    stats = train_step(policy, None, optimizer, build_scheduler(optimizer, config.optim, 10), unrecorded, config,
                       world, 0)
    assert "moe/router_agreement" not in stats and stats["moe/router_entropy"] > 0


def test_an_moe_family_rl_does_not_train_is_refused_naming_its_block():
    from transformers import MixtralConfig

    from rl.trainer.moe import use_routed_experts

    config = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"mixtral has mixture-of-experts blocks \(Mixtral\w+\) that rl cannot train"):
        use_routed_experts(model)
