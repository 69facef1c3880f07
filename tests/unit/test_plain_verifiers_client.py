"""verifiers' own clients of rl's env server (its `run` request, docs/architecture.md): a worker records the client
config it validated on every trace of the episode it sends back, and a client without rl's patches refuses fields
it does not know. So a config without rl's fields must validate as verifiers' own class, and rl's configs keep
theirs (rl/patches/verifiers.py: `serve_rl_client_configs`, applied in this process by tests/conftest.py).
benchmarks/env_workers.py is such a client: its episodes came back with rl's `group_size` and were refused."""

import pytest
import verifiers.v1 as vf
from verifiers.v1.configs.agent import WireAgentConfig
from verifiers.v1.serve.types import RunRequest

from rl.envs.chat_replies import BoundedChatConfig
from rl.envs.engine_client import GroupedTrainClientConfig

URL = "http://127.0.0.1:8000/v1"
CONFIGS = {
    "verifiers-train": vf.TrainClientConfig(base_url=URL, renderer_model_name="model"),
    "verifiers-eval": vf.EvalClientConfig(base_url=URL),
    "rl-train": GroupedTrainClientConfig(base_url=URL, renderer_model_name="model", group_size=8, group_gap_s=0.01),
    "rl-eval": BoundedChatConfig(base_url=URL, max_reply_bytes=4096),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_client_config_crosses_the_wire_as_its_own_class(name):
    config = CONFIGS[name]
    sent = config.model_dump(mode="json")
    request = RunRequest.model_validate({"task_data": {}, "client": sent, "model": "model",
                                         "sampling": vf.SamplingConfig().model_dump(mode="json")})
    assert type(request.client) is type(config) and request.client == config
    recorded = WireAgentConfig(model="model", client=request.client).model_dump(mode="json")["client"]
    assert recorded == sent  # what the worker sends back, field for field
    type(config).model_validate(recorded)  # read by the sender's own class: extra fields refused
