"""Mixture-of-experts in the trainer: the routed block rl trains, router replay, the router's metrics and its
auxiliary loss.

transformers 5 keeps each layer's experts fused in memory (`experts.gate_up_proj [E, 2I, H]`) and converts names
when it loads a checkpoint; rl loads, publishes, checksums and adapts parameters by their checkpoint names
(`experts.<e>.gate_proj.weight`, as vLLM reads them). So the sparse block is replaced, on the meta device before
sharding, by `RoutedExperts`: the same computation with one module per expert under the checkpoint's names. FSDP2
shards every expert's matrices with the rest of its transformer block.

Router replay: an MoE's trainer and inference disagree on the experts of some tokens (different kernels, dtypes,
batch shapes; a near tie flips), which changes the sampled policy the importance ratios assume. With replay the
block routes each token to the experts inference recorded for it (`route_as`), and weighs them with the softmax
of its own router logits over those experts (renormalised like top-k): the gate still gets its gradient.
A token inference did not record (-1: the last token of a sample, padding) is routed by the trainer's router.

The auxiliary load-balancing loss (Switch Transformer: E * sum_e f_e P_e) is off by default for RL: it pulls the
router towards even load whatever the reward, a change of the sampled policy that neither the advantages nor
the off-policy bounds account for; pretraining has already balanced the experts.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from rl.trainer.vision import language_model

# model_type -> how its sparse block is recognised; the block's config names are Qwen3-MoE's (Qwen3.5-MoE adds a
# gated shared expert and always renormalises the top-k weights)
MOE_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen3_5_moe_text": "Qwen3_5MoeSparseMoeBlock"}


class Expert(nn.Module):
    """One expert's gated MLP, in the checkpoint's layout."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """A top-k routed MoE block (softmax router, optional renormalisation of the k weights) and, where the family has
    one, a shared expert every token passes through, weighed by its own sigmoid gate. Its parameters are named as in
    the checkpoint: `gate.weight` [E, H], `experts.<e>.{gate,up,down}_proj.weight`, `shared_expert.*` and
    `shared_expert_gate.weight` [1, H]."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.layer, self.top_k = layer, config.num_experts_per_tok
        self.norm_topk = getattr(config, "norm_topk_prob", True)  # Qwen3.5-MoE has no switch: always renormalised
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
                                     for _ in range(self.num_experts))
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        if shared:
            self.shared_expert = Expert(config.hidden_size, shared, config.hidden_act)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.replay: torch.Tensor | None = None  # [N, k] experts to route each token to, -1: its own choice
        self.tokens: torch.Tensor | None = None  # [N] bool, the tokens that count in the statistics and aux loss
        self.counting = False  # add the next forward to the statistics (once: not its recomputation in backward)
        self.follow = True  # route as recorded (router replay); False: the record is only compared with the routing
        self.aux_loss: torch.Tensor | None = None  # of the last forward, with its gradient
        self.stats = RouterStats(self.num_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        own = probs.topk(self.top_k, dim=-1).indices  # [N, k]
        chosen = self.choose(own)
        weights = probs.gather(1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        # Every expert runs, on its tokens or on none: each gets a gradient (zero when idle), so every rank
        # reduces the same parameters' gradients whichever experts its tokens chose.
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None].to(x.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        counted = self.tokens if self.tokens is not None and self.tokens.numel() == len(x) else None
        self.aux_loss = load_balancing_loss(probs, chosen, counted)
        if self.counting:
            self.stats.add(probs.detach(), own, chosen, self.replay, counted)
            self.counting = False
        return out.reshape(hidden.shape)

    def choose(self, own: torch.Tensor) -> torch.Tensor:
        """The experts of each token: with replay, the recorded ones where there are; else the router's top-k."""
        if self.replay is None:
            return own
        if self.replay.shape != own.shape:
            raise ValueError(f"layer {self.layer}: the recorded experts are {list(self.replay.shape)} for "
                             f"{list(own.shape)} tokens x top-k")
        return torch.where(self.replay >= 0, self.replay, own) if self.follow else own


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """E * sum_e f_e P_e over the counted tokens: f_e the share of routing slots that went to e, P_e its mean
    router probability (1 when perfectly balanced)."""
    if tokens is not None:
        probs, chosen = probs[tokens], chosen[tokens]
    if not len(probs):
        return probs.sum()
    experts = probs.shape[-1]
    share = torch.bincount(chosen.flatten(), minlength=experts).float() / chosen.numel()
    return experts * (share * probs.mean(0)).sum()


class RouterStats:
    """Sums over a step of one block's router, kept on the device (no host sync per micro-batch): entropy and
    tokens counted, and how many routing slots each expert took."""

    def __init__(self, experts: int):
        self.experts = experts
        # [5 + E]: entropy, tokens, recorded tokens, those whose router chose as recorded, those routed as recorded,
        # then each expert's routing slots
        self.sums: torch.Tensor | None = None

    def reset(self) -> None:
        self.sums = None

    def add(self, probs: torch.Tensor, own: torch.Tensor, chosen: torch.Tensor, recorded: torch.Tensor | None,
            tokens: torch.Tensor | None) -> None:
        if recorded is None:
            recorded = torch.full_like(own, -1)
        if tokens is not None:
            probs, own, chosen, recorded = probs[tokens], own[tokens], chosen[tokens], recorded[tokens]
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum()
        load = torch.bincount(chosen.flatten(), minlength=self.experts)
        has_record = (recorded >= 0).all(-1)
        record = recorded.sort(-1).values
        own_agrees = has_record & (own.sort(-1).values == record).all(-1)
        chosen_agrees = has_record & (chosen.sort(-1).values == record).all(-1)
        counts = torch.stack([torch.tensor(len(probs), device=probs.device), has_record.sum(), own_agrees.sum(),
                              chosen_agrees.sum()])
        row = torch.cat([entropy.double()[None], counts.double(), load.double()])
        self.sums = row if self.sums is None else self.sums + row

    def totals(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(5 + self.experts, dtype=torch.float64, device=device) if self.sums is None else self.sums


def moe_blocks(model: nn.Module) -> list[RoutedExperts]:
    """The model's MoE blocks in layer order, as `use_routed_experts` listed them (no walk over every module on each
    forward: an MoE holds thousands of expert projections); none for a dense model."""
    return getattr(model, "rl_moe_blocks", [])


def use_routed_experts(model: nn.Module) -> int:
    """Replace the model's sparse MoE blocks (on the meta device) by `RoutedExperts`; how many were replaced. A
    model with MoE blocks of a family rl does not know is refused, naming it."""
    model_type = model.config.model_type
    block_class = MOE_BLOCKS.get(model_type)
    sparse = [type(m).__name__ for m in model.modules() if hasattr(m, "experts")]  # any family's sparse block
    if block_class is None:
        if sparse:
            raise ValueError(f"{model_type} has mixture-of-experts blocks ({sparse[0]}) that rl cannot train yet; "
                             f"it trains {sorted(MOE_BLOCKS)}")
        return 0
    blocks = []
    for index, layer in enumerate(language_model(model).layers):
        if type(layer.mlp).__name__ == block_class:
            layer.mlp = RoutedExperts(model.config, index)
            blocks.append(layer.mlp)
    model.rl_moe_blocks = blocks
    return len(blocks)


def follow_records(model: nn.Module, follow: bool) -> None:
    """Route as inference recorded (router replay), or only compare the routing with the record."""
    for block in moe_blocks(model):
        block.follow = follow


def route_as(model: nn.Module, routed: torch.Tensor | None, tokens: torch.Tensor | None, count: bool) -> None:
    """Set the experts each MoE block routes the next forward's tokens to: `routed` [B, T, L, k] as inference
    recorded them (-1: the block's own choice), or None for the model's own routing; `tokens` [B, T] the real
    tokens (statistics and aux loss count only these); `count`: add that forward to the step's router statistics
    (the trained pass, not the reference's). Stays set until the next call: activation checkpointing recomputes
    the forward in backward, which must route the same way."""
    for block in moe_blocks(model):
        block.replay = None if routed is None else routed[:, :, block.layer].reshape(-1, block.top_k)
        block.tokens = None if tokens is None else tokens.reshape(-1)
        block.counting = count


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The mean over MoE blocks of their last forward's load-balancing loss; None for a dense model."""
    losses = [b.aux_loss for b in moe_blocks(model) if b.aux_loss is not None]
    return torch.stack(losses).mean() if losses else None


def check_routed(routed: torch.Tensor, layers: int, top_k: int, experts: int, sample: int) -> None:
    """A sample's recorded experts [T, L, k] must fit the model; raise ValueError naming the sample."""
    if routed.ndim != 3 or routed.shape[1:] != (layers, top_k):
        raise ValueError(f"sample {sample}: recorded experts of shape {list(routed.shape)}, the model routes "
                         f"[tokens, {layers} layers, top-{top_k}]")
    if routed.numel() and (int(routed.max()) >= experts or int(routed.min()) < -1):
        raise ValueError(f"sample {sample}: a recorded expert id out of range (min {int(routed.min())}, "
                         f"max {int(routed.max())}; the model has {experts} experts)")
    ordered = routed.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if repeated.any():  # replay would route the token twice to one expert, and to one expert fewer than top-k
        token, layer, _ = repeated.nonzero()[0].tolist()
        raise ValueError(f"sample {sample}: token {token}'s recorded experts in layer {layer} repeat one "
                         f"({routed[token, layer].tolist()}); a token is routed to {top_k} distinct experts")


def router_metrics(model: nn.Module, all_reduce) -> dict[str, float]:
    """The step's router metrics, over all ranks (`all_reduce` sums a list of floats), and the statistics reset:
    `moe/router_entropy` (mean per token and layer, nats), `moe/max_expert_share` (the most loaded expert's share of
    a layer's routing slots, the largest over layers; 1/E is even); with inference's record, the shares of recorded
    token-layers whose router chose the recorded experts (`moe/router_agreement`) and that were routed to them
    (`moe/routed_as_recorded`: 1 with replay); `moe/aux_loss` is the step's."""
    blocks = moe_blocks(model)
    if not blocks:
        return {}
    device = blocks[0].gate.weight.device
    local = torch.cat([b.stats.totals(device) for b in blocks]).tolist()  # one host sync for every block
    summed = all_reduce(local)
    width = 5 + blocks[0].num_experts
    rows = [summed[i * width:(i + 1) * width] for i in range(len(blocks))]
    entropy, tokens, recorded, own, routed = (sum(row[j] for row in rows) for j in range(5))
    shares = [max(row[5:]) / sum(row[5:]) if sum(row[5:]) else 0.0 for row in rows]
    for block in blocks:
        block.stats.reset()
    agreement = {"moe/router_agreement": own / recorded, "moe/routed_as_recorded": routed / recorded} \
        if recorded else {}
    return agreement | {"moe/router_entropy": entropy / max(tokens, 1), "moe/max_expert_share": max(shares)}
