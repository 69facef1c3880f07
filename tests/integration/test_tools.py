"""Tool environments for real: a `vf-init --add-tool`-shaped environment (tests/fixtures/environments/toolset_env,
a task-scoped MCP toolset) on the tiny model and a real vLLM server. Scripted completions (vLLM structured
outputs) call its tools and get their real results back, errors included, masked from training; `rl` trains
it for 3 steps with the tool schemas in every prompt; `eval` writes its tool metrics."""

import asyncio
import json
import re
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rl.envs.config import EnvConfig
from rl.envs.loading import load_environment
from rl.envs.rollouts import InferenceClient, Sampling, run_group
from rl.protocol import RunPaths, read_metrics
from rl.renderer import renderer_config
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT
from tests.integration.inference_server import Server
from tests.integration.launched import SMALL_KV_CACHE, Launched, free_port, rl_command

pytestmark = pytest.mark.integration
FIXTURES = ROOT / "tests" / "fixtures" / "environments"
PROMPT_TOKENS = 2048  # the two tools' JSON schemas take ~800 of the character-level model's tokens


@pytest.fixture
def toolset_env_installed(monkeypatch):
    # absolute: verifiers starts the tool server as `python -m toolset_env.tools` in a directory of its own
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    monkeypatch.syspath_prepend(str(FIXTURES))


def scripted(tokenizer, tool: str, arguments: dict, xml: bool = False) -> Sampling:
    """Every turn is exactly this tool call, in Qwen3's JSON or Qwen3.5's XML. The tags must come out as the
    single tokens the tool parser reads (the regex alone also admits spelling them character by character): JSON
    bans '<'; XML needs '<' for `<function=`, so there the tag tokens are raised instead, and the regex masks them
    wherever it expects anything else."""
    tags = [tokenizer.convert_tokens_to_ids(tag) for tag in ("<tool_call>", "</tool_call>")]
    if xml:
        parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
        call = f"<tool_call>\n<function={tool}>\n{parameters}</function>\n</tool_call>"
        bias = {str(tag): 100 for tag in tags}
    else:
        call = f'<tool_call>\n{{"name": "{tool}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        bias = {str(tokenizer.convert_tokens_to_ids("<")): -100}
    return Sampling(max_tokens=120, extra={"structured_outputs": {"regex": re.escape(call)}, "logit_bias": bias})


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_scripted_tool_calls_get_the_tools_real_results(arch, tiny_model, tmp_path, toolset_env_installed):
    """Qwen3's JSON calls on the tiny model, and Qwen3.5's XML calls through its own renderer (picked by `auto`)."""
    model = tiny_model if arch == "qwen3" else build_tiny_model(tmp_path / arch, arch=arch)
    env = load_environment(EnvConfig(id="toolset-env", harness={"id": "in-process-chat", "max_tool_calls": 1}))
    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer, _ = renderer_config("auto", str(model))
    assert renderer.name == {"qwen3": "default", "qwen3_5": "qwen3.5"}[arch]
    server = Server(model, tmp_path / "weights", tmp_path / "inference.log", max_model_len=PROMPT_TOKENS)
    client = InferenceClient(server.url, str(model), str(model), renderer)

    async def rollouts():
        async with env.serving():
            return [
                (await run_group(env, 0, 1, client, scripted(tokenizer, tool, arguments, arch == "qwen3_5"),
                                 timeout_s=300))[0]
                for tool, arguments in (("kv_lookup", {"key": "red"}), ("kv_explode", {}), ("kv_nope", {}))
            ]

    try:
        looked_up, exploded, unknown = asyncio.run(rollouts())
    finally:
        server.stop()
    answers = {}
    for name, result in (("lookup", looked_up), ("explode", exploded), ("unknown", unknown)):
        (segment,) = result.segments  # the tool turn extends the sampled tokens: one segment
        prompt = tokenizer.decode(segment.prompt_ids)
        assert '"name": "kv_lookup"' in prompt and '"name": "kv_explode"' in prompt  # the offered schemas
        trained = [t for t, m in zip(segment.completion_ids, segment.completion_mask) if m]
        masked = [t for t, m in zip(segment.completion_ids, segment.completion_mask) if not m]
        assert "<tool_response>" not in tokenizer.decode(trained)
        answers[name] = tokenizer.decode(masked)
        assert result.num_turns == 2 and result.tool_calls == 1
    assert "<tool_response>\n7431\n</tool_response>" in answers["lookup"] and looked_up.tool_errors == 0
    assert "error: Error executing tool explode: the explode tool always fails" in answers["explode"]
    assert "error: unknown tool 'kv_nope'; the tools are kv_explode, kv_lookup" in answers["unknown"]
    assert (exploded.tool_errors, unknown.tool_errors) == (1, 1)


TOOL_RUN = """
[[env]]
id = "toolset-env"
harness = { id = "in-process-chat", max_tool_calls = 2 }
[sampling]
max_tokens = 24
"""


def test_rl_trains_a_tool_environment_and_eval_reports_its_tools(tiny_model, tmp_path, toolset_env_installed):
    orch = tmp_path / "tools.toml"
    orch.write_text(TOOL_RUN)
    out = tmp_path / "run"
    # one group of 4 a step: a task-scoped toolset starts a server (a Python process, ~190 MB) per rollout
    small = ["--orchestrator.batch-size", "4", "--orchestrator.rollouts-per-example", "4"]
    run = Launched(
        rl_command(tiny_model, out, 2, "--orchestrator", "@", str(orch), "--seq-len", str(PROMPT_TOKENS), *small)
    )
    assert run.wait(timeout=900) == 0, run.output[-5000:]
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "toolsets kv" in log and "renders with default {'tool_parser': 'qwen3'}" in log
    records = [m for m in read_metrics(RunPaths(out)) if m["process"] == "orchestrator"]
    assert [m["step"] for m in records] == [0, 1]
    for m in records:
        assert m["tools/toolset-env/calls"] >= 0 and m["tools/toolset-env/errors"] >= 0 and m["turns/toolset-env"] >= 1
    assert [m["step"] for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"] == [0, 1]

    evaluated = tmp_path / "eval"
    done = subprocess.run(
        [sys.executable, "-m", "rl.eval.main", "--model.name", str(tiny_model),
         "--env", json.dumps([{"id": "toolset-env"}]),
         "--num-examples", "1", "--rollouts-per-example", "2",
         "--sampling.temperature", "1.0", "--sampling.max-tokens", "24",
         "--inference.max-model-len", str(PROMPT_TOKENS), "--inference.port", str(free_port()),
         "--output-dir", str(evaluated), *SMALL_KV_CACHE],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((evaluated / "summary.json").read_text())["envs"]["toolset-env"]
    assert {"tools/calls", "tools/errors", "turns"} <= set(summary)
    records = [json.loads(line) for line in (evaluated / "results.jsonl").read_text().splitlines()]
    assert all(r["tool_calls"] is not None and '"name": "kv_lookup"' in r["prompt"] for r in records)
