"""The Tinker SDK's protobuf messages (its `tinker.proto.tinker_public_pb2`, SDK 0.38) as rl's service reads and
writes them: a forward/backward request into datums of numpy arrays, and the two replies the SDK only takes as
protobuf (forward/backward outputs, samples). Every array on this wire is raw little-endian bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request rl cannot read or does not support; its message names what (answered with HTTP 400)."""


@dataclass
class Datum:
    tokens: np.ndarray  # [N] int64: the model input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, each [N] (target_tokens int64, weights/logprobs/advantages float32)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool


def tensor_array(tensor: pb.Tensor, name: str) -> np.ndarray:
    if tensor.WhichOneof("encoding") != "dense":
        raise WireError(f"loss_fn_inputs[{name!r}] is sparse; rl serve-api reads dense tensors only")
    if tensor.dtype not in DTYPES:
        raise WireError(f"loss_fn_inputs[{name!r}] has dtype {pb.DType.Name(tensor.dtype)}; rl reads float32, int64 "
                        "and int32")
    array = np.frombuffer(tensor.dense, dtype=DTYPES[tensor.dtype])
    shape = list(tensor.shape) or [array.size]
    if int(np.prod(shape)) != array.size:
        raise WireError(f"loss_fn_inputs[{name!r}] holds {array.size} values, not its shape {shape}")
    return array.reshape(shape).copy()


def datum_tokens(datum: pb.Datum, index: int) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {index} holds a {kind} chunk; rl serve-api trains on encoded text only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def read_forward_backward(body: bytes) -> ForwardBackward:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError and the like
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest: {e}") from None
    datums = []
    for i, datum in enumerate(request.data):
        tokens = datum_tokens(datum, i)
        inputs = {name: tensor_array(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
        for name, array in inputs.items():
            if array.ndim != 1 or len(array) != len(tokens):
                raise WireError(f"datum {i}'s loss_fn_inputs[{name!r}] has shape {list(array.shape)}; rl takes one "
                                f"value per input token ({len(tokens)})")
        datums.append(Datum(tokens, inputs))
    config = {key: value.number for key, value in request.loss_fn_config_v2.items()
              if value.WhichOneof("value") == "number"} or dict(request.loss_fn_config)
    return ForwardBackward(request.model_id, request.seq_id, datums, request.loss_fn, config, request.forward_only)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord of every datum's `logprobs` (float32, one per input token) and the call's metrics."""
    arrays = [np.asarray(a, dtype="<f4") for a in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    field = pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                             dtype=pb.DTYPE_FLOAT32)
    record = pb.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": field}, num_datums=len(arrays))
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # at a stop condition; else at max_tokens


def sample_output(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    reply = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                           tokens=np.asarray(s.tokens, "<i4").tobytes(),
                           logprobs=np.asarray(s.logprobs, "<f4").tobytes())
        for s in sequences
    ])
    if prompt_logprobs is not None:  # None (the first token's) travels as NaN
        values = [np.nan if v is None else v for v in prompt_logprobs]
        reply.prompt_logprobs = np.asarray(values, "<f4").tobytes()
    return reply.SerializeToString()
