"""Build a tiny causal LM with a locally made tokenizer, in Hugging Face layout: Qwen3 by default, or another
family users bring (`--arch`): Qwen3-MoE (8 experts, 2 per token), Llama 3 (untied head), Qwen2.5 (q/k/v biases,
tied), Gemma 3 (text: sliding and full attention layers, the embedding scaled, (1 + w) norms) or Qwen3.5, dense or
MoE (text: Gated DeltaNet linear attention in three layers of four, full attention in the fourth).

No hub access: the tokenizer is character level (printable ASCII plus ChatML special tokens and Qwen3's
think and tool tokens, each one id) with its family's chat format (rl/chat_templates.py): Qwen3's (tool calls
as `<tool_call>` JSON, read by the `default` renderer with Qwen3's parser) or, for Qwen3.5, Qwen3.5's (XML tool
calls, think blocks, vision tokens: the `qwen3.5` renderer reads it). The weights are drawn from a seeded
generator, so the same arguments always give the same files. vLLM's CPU attention kernels need head_dim >= 32.

    uv run tiny-model --out models/tiny            # ~0.8M parameters
    uv run tiny-model --out models/tiny-moe --arch qwen3_moe
    uv run tiny-model --out models/m100 --hidden-size 768 --layers 12 --heads 12 --kv-heads 4
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM, AutoModelForImageTextToText, Gemma3TextConfig, LlamaConfig, PretrainedConfig,
    PreTrainedTokenizerFast, Qwen2Config, Qwen3_5Config, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3_5VisionConfig,
    Qwen3Config, Qwen3MoeConfig,
)

from rl import chat_templates

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))
# Qwen3's own: one id each (parsers find tool calls by token id), appended so earlier ids stay put.
TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen3.5's vision placeholders: its renderer needs them in the vocabulary, text-only or not.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tokenizer(arch: str = "qwen3") -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per printable ASCII character, ChatML special tokens, Qwen3's
    think and tool tokens (plain added tokens, as in Qwen3: decoded text keeps them); Qwen3.5's adds its vision
    tokens (special: decoding drops them) and renders chats in Qwen3.5's format (rl/chat_templates.py)."""
    qwen3_5 = arch.startswith("qwen3_5")
    vision = VISION_TOKENS if qwen3_5 else []
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ["<unk>"] + CHARACTERS + TOOL_TOKENS + vision)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character its own piece, newlines too (a plain "." would leave a blank line one unknown piece)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[1:] + vision,
    )
    tokenizer.add_tokens(TOOL_TOKENS)  # in the vocabulary already: this only makes each match whole
    tokenizer.chat_template = chat_templates.QWEN3_5 if qwen3_5 else chat_templates.QWEN3
    return tokenizer


ARCHS = ("qwen3", "qwen3_moe", "llama", "qwen2", "gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl")
# What Qwen3.5's image processor is told (preprocessor_config.json): 16-pixel patches, 2x2 of them to a token, images
# scaled to between 32x32 and 128x128 pixels, so a tiny model's image is 1 to 16 tokens.
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
    "merge_size": 2, "temporal_patch_size": 2, "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_resize": True, "do_convert_rgb": True,
}


def build_config(tokenizer, hidden_size: int, layers: int, heads: int, kv_heads: int,
                 arch: str = "qwen3") -> PretrainedConfig:
    """The family's config at this size; each family's own choices where they differ (ties, biases, norms,
    attention layout, experts), in sizes vLLM's CPU kernels take (head_dim 32, hidden a multiple of 32)."""
    head_dim = hidden_size // heads
    if head_dim < 32 or hidden_size % heads:
        raise ValueError(
            f"hidden_size {hidden_size} / heads {heads} must divide evenly into head_dim >= 32 "
            "(vLLM's CPU attention rejects smaller heads)"
        )
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=2048, bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if arch == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=True)
    if arch == "qwen3_moe":  # every layer sparse, as Qwen3-30B-A3B; experts' width a multiple of 32
        return Qwen3MoeConfig(**common, tie_word_embeddings=True, moe_intermediate_size=hidden_size // 2,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    if arch == "llama":  # Llama 3's: an untied head, rope theta 500k
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0)
    if arch == "qwen2":  # Qwen2.5's small models: q/k/v biases, a tied head, no q/k norms
        common.pop("head_dim")
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "gemma3":  # text only: 5 sliding layers to a full one (the last, in fewer than 6), tied head
        full_every = min(6, layers)
        return Gemma3TextConfig(**common, tie_word_embeddings=True, query_pre_attn_scalar=head_dim,
                                sliding_window=64, layer_types=["full_attention" if (i + 1) % full_every == 0
                                                                else "sliding_attention" for i in range(layers)])
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5_config(common, arch == "qwen3_5_moe")
    if arch == "qwen3_5_vl":
        return qwen3_5_vl_config(tokenizer, qwen3_5_config(common, moe=False))
    raise ValueError(f"--arch {arch!r}: choose from {', '.join(ARCHS)}")


def qwen3_5_config(common: dict, moe: bool) -> PretrainedConfig:
    """Qwen3.5's text model: every 4th layer full attention (with an output gate), the others Gated DeltaNet
    (linear attention: 2 key heads shared by 4 value heads, as the real configs share them, of head_dim's width);
    the MoE adds a gated shared expert beside 8 routed ones, 2 per token, in every layer. A tied head, as the small
    Qwen3.5 models have."""
    head_dim, layers = common["head_dim"], common["num_hidden_layers"]
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim,
                  linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, layer_types=kinds)
    # The real models rotate a quarter of head_dim 256 (64 dims, 32 frequencies); a quarter of 32 leaves 4
    # frequencies, too few to tell nearby positions apart: the quickstart's SFT then stalls at loss 2.7. All 32 rotate.
    linear["partial_rotary_factor"] = 1.0
    if not moe:
        return Qwen3_5TextConfig(**common, **linear, tie_word_embeddings=True)
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=common["hidden_size"] // 2,
                   shared_expert_intermediate_size=common["hidden_size"] // 2)
    return Qwen3_5MoeTextConfig(**common, **linear, **experts, tie_word_embeddings=True)


def qwen3_5_vl_config(tokenizer, text: PretrainedConfig) -> PretrainedConfig:
    """Qwen3.5 as its checkpoints ship (`Qwen3_5ForConditionalGeneration`): the text model above beside a vision
    tower (one block, width 64, 16-pixel patches merged 2x2 into one token of the text model's width). Image tokens
    take 3-D rotary positions (time, height, width: interleaved sections of the 16 frequencies, as the real 11/11/10
    of 32)."""
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[6, 5, 5], mrope_interleaved=True)
    vision = Qwen3_5VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                                 spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text.hidden_size,
                                 num_position_embeddings=256)
    ids = {f"{kind}_token_id": tokenizer.convert_tokens_to_ids(f"<|{kind}_pad|>") for kind in ("image", "video")}
    ids |= {f"vision_{edge}_token_id": tokenizer.convert_tokens_to_ids(f"<|vision_{edge}|>")
            for edge in ("start", "end")}
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=True, **ids)


def build_tiny_model(
    out: str | Path,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    arch: str = "qwen3",
) -> Path:
    """Write config, safetensors weights, tokenizer and generation config to `out`; return it."""
    out = Path(out)
    tokenizer = build_tokenizer(arch)
    config = build_config(tokenizer, hidden_size, layers, heads, kv_heads, arch)
    # Draw the weights for the vocabulary without the tool (and vision) tokens, then append rows for those: every
    # other weight is what the same seed gave before those tokens existed, so the quickstart's measured SFT and
    # RL behaviour (benchmarks/RESULTS.md) still holds.
    config.get_text_config().vocab_size = len(SPECIAL_TOKENS) + 1 + len(CHARACTERS)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch == "qwen3_5_vl" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    remember_across_tokens(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if arch == "qwen3_5_vl":
        (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2) + "\n")
    (out / "tiny_model.json").write_text(
        json.dumps({"seed": seed, "hidden_size": hidden_size, "layers": layers, "heads": heads, "arch": arch}) + "\n"
    )
    return out


def remember_across_tokens(model: torch.nn.Module, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Gated DeltaNet's time steps drawn as fla and Mamba 2 draw them (log-uniform in [dt_min, dt_max], dt_bias their
    inverse softplus). transformers' init (dt_bias = 1) makes each token's decay exp(-A softplus(1 + a)) ~ 1e-5 for
    its A ~ U(0, 16): the state forgets everything at every token, only the one attention layer in four mixes
    tokens, and the quickstart's SFT never learns to reverse text (loss stays at 2.77, where Qwen3's falls to 1.3).
    Real checkpoints bring their trained values; this is for a model built from nothing."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            with torch.no_grad():
                low, high = torch.log(torch.tensor(dt_min)), torch.log(torch.tensor(dt_max))
                dt = torch.exp(low + torch.rand(module.dt_bias.shape) * (high - low))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3", help="the model family")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, args.hidden_size, args.layers, args.heads, args.kv_heads, args.seed, args.arch)
    print(f"wrote tiny {args.arch} model to {path}")


if __name__ == "__main__":
    main()
