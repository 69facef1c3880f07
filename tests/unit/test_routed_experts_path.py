"""An MoE's routed experts on their way from vLLM to the batch file: the gate rewrites vLLM's `.npy` rows into what
verifiers' client reads (with the first position they cover), verifiers attributes them to the trace's tokens, the
orchestrator puts them in each sample, all or none of a batch's."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from renderers.client import parse_generate_response

from rl.envs.rollouts import to_segment
from rl.inference.gate import GenerateResponse
from rl.orchestrator.batch import route_all_or_none, routed_rows, to_sample
from rl.samples import Sample

LAYERS, TOP_K = 4, 2


def vllm_reply(prompt: int, completion: int, start: int) -> tuple[dict, np.ndarray]:
    """A generate reply as vLLM 0.32 writes it with --enable-return-routed-experts: rows for positions
    [start, prompt + completion - 1), base64 of a .npy file."""
    rows = np.random.default_rng(0).integers(0, 8, (prompt + completion - 1 - start, LAYERS, TOP_K), dtype=np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, rows)
    choice = {"index": 0, "token_ids": list(range(completion)), "finish_reason": "stop", "logprobs": None,
              "routed_experts": base64.b64encode(buffer.getvalue()).decode()}
    return {"request_id": "r", "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}, rows


def test_the_gate_gives_verifiers_client_the_rows_and_where_they_start():
    for start in (0, 7):  # a first turn, and a later turn that asked for rows after its reused prefix only
        reply, rows = vllm_reply(prompt=12, completion=5, start=start)
        parsed = parse_generate_response(GenerateResponse(reply).body)
        routed = parsed["choices"][0]["routed_experts"]
        assert routed["start"] == start and routed["shape"] == list(rows.shape) and routed["dtype"] == "uint8"
        back = np.frombuffer(base64.b64decode(bytes(routed["data"])), dtype=routed["dtype"]).reshape(routed["shape"])
        assert np.array_equal(back, rows)


def test_a_reply_without_routed_experts_is_left_as_it_is():
    reply, _ = vllm_reply(prompt=4, completion=3, start=0)
    reply["choices"][0]["routed_experts"] = None
    assert parse_generate_response(GenerateResponse(reply).body)["choices"][0]["routed_experts"] is None


def test_samples_carry_each_tokens_experts_and_a_batch_has_them_all_or_none():
    ids = list(range(10))
    mask = [False] * 4 + [True] * 6
    rows = np.random.default_rng(1).integers(0, 8, (10, LAYERS, TOP_K), dtype=np.uint8)
    routed = to_segment(ids, mask, [0.0] * 10, [1] * 10, rows)
    unrouted = to_segment(ids, mask, [0.0] * 10, [1] * 10, rows[:9])  # rows that do not fit the tokens: none
    assert unrouted.routed_experts is None
    samples = [to_sample(routed, 1.0, 0.5, 1), to_sample(unrouted, 0.0, -0.5, 1)]
    assert torch.equal(samples[0].routed_experts[:-1], torch.from_numpy(rows[:-1].astype(np.int16)))
    assert (samples[0].routed_experts[-1] == -1).all()  # never computed by inference: verifiers' placeholder
    assert route_all_or_none(samples) == 1
    assert torch.equal(samples[1].routed_experts, torch.full((10, LAYERS, TOP_K), -1, dtype=torch.int16))
    dense = [Sample([1, 2], [0, 1], [0.0, -1.0], 1.0, 1.0, 0)]
    assert route_all_or_none(dense) == 0 and dense[0].routed_experts is None
    assert routed_rows(rows).dtype == torch.int16
