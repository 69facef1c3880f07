"""rl serve-api's protobuf wire against the Tinker SDK's own encoder and decoders, and the Tinker losses against their
formulas (rl/service/wire.py, rl/trainer/tinker_ops.py)."""

import math

import numpy as np
import pytest
import torch
import tinker
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from rl.service.wire import Sequence, WireError, forward_backward_output, read_forward_backward, sample_output
from rl.trainer.tinker_ops import CallError, check_call, datum_sample, micro_batches, tinker_loss


def sdk_body(data, loss_fn="importance_sampling", config=None) -> bytes:
    request = ForwardBackwardRequest(ForwardBackwardInput(data, loss_fn, config), model_id="s:train:0", seq_id=3)
    return forward_backward_request_to_proto(request).SerializeToString()


def rl_datum(tokens: list[int], **inputs) -> tinker.Datum:
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_a_request_the_sdk_encodes_reads_back_token_for_token():
    data = [rl_datum([5, 6, 7], target_tokens=[6, 7, 8], logprobs=[-1.0, -2.0, -0.5], advantages=[1.0, 1.0, -1.0]),
            rl_datum([9, 10], target_tokens=[10, 11], logprobs=[-0.1, -0.2], advantages=[0.5, 0.5])]
    request = read_forward_backward(sdk_body(data, "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}))
    assert (request.model_id, request.seq_id, request.loss_fn, request.forward_only) == ("s:train:0", 3, "ppo", False)
    assert request.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    assert [d.tokens.tolist() for d in request.datums] == [[5, 6, 7], [9, 10]]
    first = request.datums[0].inputs
    assert first["target_tokens"].dtype == np.int64 and first["target_tokens"].tolist() == [6, 7, 8]
    assert first["logprobs"].tolist() == [-1.0, -2.0, -0.5] and first["advantages"].tolist() == [1.0, 1.0, -1.0]


def test_an_input_of_another_length_than_the_tokens_is_refused_by_name():
    body = sdk_body([rl_datum([5, 6, 7], target_tokens=[6, 7], weights=[1.0, 1.0, 1.0])], "cross_entropy")
    with pytest.raises(WireError, match=r"datum 0's loss_fn_inputs\['target_tokens'\] has shape \[2\]"):
        read_forward_backward(body)
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff")


def test_outputs_the_sdk_decodes_hold_each_datums_logprobs_and_the_metrics():
    reply = forward_backward_output([np.array([-1.5, -0.25]), np.array([-3.0, -2.0, -0.5])], {"loss:sum": 4.5})
    decoded = deserialize_forward_backward_output(reply)
    assert decoded.metrics == {"loss:sum": 4.5}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.5, -0.25], [-3.0, -2.0, -0.5]]


def test_samples_the_sdk_decodes_keep_tokens_logprobs_stop_reasons_and_prompt_logprobs():
    reply = sample_output([Sequence([4, 5], [-0.5, -1.0], True), Sequence([6], [-2.0], False)], [None, -1.25, -0.5])
    decoded = deserialize_sample_response(reply)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in decoded.sequences] == [
        ([4, 5], [-0.5, -1.0], "stop"), ([6], [-2.0], "length")]
    assert decoded.prompt_logprobs == [None, -1.25, -0.5]


def tensors(tokens, **inputs):
    return {"tokens": torch.tensor(tokens), **{k: torch.tensor(v) for k, v in inputs.items()}}


def test_targets_that_are_not_the_inputs_shifted_by_one_are_refused_naming_the_position():
    check_call("cross_entropy", {}, [tensors([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0] * 3)], 64, 100)
    with pytest.raises(CallError, match=r"target_tokens\[1\] = 9 is not model_input\[2\] = 3"):
        check_call("cross_entropy", {}, [tensors([1, 2, 3], target_tokens=[2, 9, 4], weights=[1.0] * 3)], 64, 100)
    with pytest.raises(CallError, match="loss_fn 'dro' is not one rl serve-api computes"):
        check_call("dro", {}, [], 64, 100)
    with pytest.raises(CallError, match=r"lacks loss_fn_inputs \['advantages'\]"):
        check_call("ppo", {}, [tensors([1, 2], target_tokens=[2, 3], logprobs=[0.0, 0.0])], 64, 100)
    with pytest.raises(CallError, match=r"outside the model's vocabulary of 100: \[100, 120\]"):
        check_call("cross_entropy", {}, [tensors([1, 120, 3], target_tokens=[120, 3, 100], weights=[1.0] * 3)], 64, 100)
    with pytest.raises(CallError, match="seq_len is 3"):
        check_call("cross_entropy", {}, [tensors([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0] * 3)], 3, 100)


def test_a_datum_is_one_sequence_whose_position_i_plus_1_holds_target_i():
    sample = datum_sample(tensors([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0, -2.0, -3.0]))
    assert sample.input_ids == [1, 2, 3, 4] and sample.loss_mask == [0, 1, 1, 1]
    assert sample.logprobs == [0.0, -1.0, -2.0, -3.0]


def test_packed_rows_carry_each_datums_weights_and_advantages_at_its_own_positions():
    datums = [tensors([1, 2], target_tokens=[2, 3], weights=[0.5, 2.0]),
              tensors([7, 8, 9], target_tokens=[8, 9, 10], weights=[1.0, 0.0, 3.0])]
    (mb, row), = micro_batches(datums, 64)
    order = {i: datums[i] for i in row}
    expected = torch.cat([torch.cat([torch.zeros(1), order[i]["weights"]]) for i in row])
    assert torch.equal(mb.weights[0], expected) and mb.input_ids.shape == (1, 7)
    assert mb.sample_lengths == tuple(len(order[i]["tokens"]) + 1 for i in row)


def one_row(logprobs, sampled, advantages, weights=None):
    (mb, _), = micro_batches([tensors([1] * len(logprobs), target_tokens=[1] * len(logprobs), logprobs=sampled,
                                      advantages=advantages, weights=weights or [0.0] * len(logprobs))], 64)
    return torch.tensor([[0.0, *logprobs]]), mb


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_each_loss_is_its_formula_summed_over_positions(loss_fn):
    lp, q, a, w = [-1.0, -0.2, -2.0], [-1.5, -0.2, -1.0], [1.0, -2.0, 0.5], [1.0, 0.5, 2.0]
    logprobs, mb = one_row(lp, q, a, w)
    got = float(tinker_loss(loss_fn, logprobs, mb, {}))
    r = [math.exp(x - y) for x, y in zip(lp, q)]
    clip = [min(max(v, 0.8), 1.2) for v in r]
    expected = {
        "cross_entropy": -sum(x * y for x, y in zip(lp, w)),
        "importance_sampling": -sum(x * y for x, y in zip(r, a)),
        "ppo": -sum(min(x * y, c * y) for x, y, c in zip(r, a, clip)),
        "cispo": -sum(c * x * y for c, x, y in zip(clip, lp, a)),
    }[loss_fn]
    assert got == pytest.approx(expected, rel=1e-6)


def test_ppo_takes_its_clip_thresholds_from_the_call():
    logprobs, mb = one_row([0.0], [-1.0], [1.0])  # ratio e: clipped to the high threshold
    assert float(tinker_loss("ppo", logprobs, mb, {"clip_high_threshold": 1.5})) == pytest.approx(-1.5)
    assert float(tinker_loss("ppo", logprobs, mb, {})) == pytest.approx(-1.2)
