"""Re-scoring a batch's older samples under the policy it trains (rl/orchestrator/rescore.py) against fake vLLM
servers, and the trainer refusing a batch without them where a mask reads them."""

import asyncio
from dataclasses import replace

import httpx
import pytest
import torch

from rl.orchestrator.rescore import rescore
from rl.orchestrator.teacher import TeacherError
from tests.unit.test_teacher import fake_logprob, fake_vllm, sample, teacher


def stale(ids: list[int], version: int, token_versions: list[int] | None = None):
    return replace(sample(ids, 1), policy_version=version, token_versions=token_versions)


def test_only_samples_older_than_the_step_are_rescored_spread_over_the_servers():
    requests = [[], []]
    servers = [teacher(fake_vllm(r), batch_tokens=100) for r in requests]
    samples = [stale([1, 2, 3], 4), stale([4, 5, 6], 3), stale([7, 8], 5), stale([9, 10, 11], 5, [4, 5, 5]),
               stale([12, 13], 2)]
    scored, count = asyncio.run(rescore(samples, 5, servers))
    assert count == 4  # sample 2 is wholly policy 5's; sample 3's first token is policy 4's
    assert sorted(len(r[0]["prompt"]) for r in requests) == [2, 2]  # 4 stale samples over 2 servers, one request each
    assert scored[2].rescored_logprobs == samples[2].logprobs
    for s in (scored[0], scored[1], scored[3], scored[4]):
        assert s.rescored_logprobs == [fake_logprob(t) if m else 0.0 for t, m in zip(s.input_ids, s.loss_mask)]
        assert s.teacher_logprobs is None and s.logprobs != s.rescored_logprobs  # the sampling ones kept


def test_a_servers_bad_reply_names_the_batch_and_server_and_images_are_refused():
    with pytest.raises(TeacherError, match="re-scoring batch 3 on the server at http://teacher:8001 .*lack token 2"):
        asyncio.run(rescore([stale([1, 2, 3], 1)], 3, [teacher(fake_vllm([], drop_token=2))]))
    pictured = replace(stale([1, 2], 0), pixel_values=torch.zeros(4, 3), image_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(TeacherError, match="samples with images sampled under an older policy"):
        asyncio.run(rescore([pictured], 1, [teacher(httpx.MockTransport(lambda r: httpx.Response(500)))]))


def test_the_trainer_refuses_a_batch_without_rescored_logprobs_where_a_mask_reads_them():
    from rl.trainer.config import TrainerConfig
    from rl.trainer.step import train_step

    config = TrainerConfig(loss={"mismatch": [{"type": "geo_mask", "against": "rescored"}]})
    with pytest.raises(ValueError, match="against = 'rescored' but the batch carries no rescored logprobs"):
        train_step(None, None, None, None, [stale([1, 2, 3], 0)], config, None, 0)
