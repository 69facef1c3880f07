"""Tool environments without a server: the renderer rl picks per model, the start-up refusals, and the
in-process harness's tool loop against a stand-in model and toolbox."""

import asyncio
import shutil

import pytest
from renderers.configs import DefaultRendererConfig, Qwen3RendererConfig, Qwen35RendererConfig
from renderers.qwen35 import Qwen35Renderer
from transformers import AutoTokenizer

import in_process_chat
from in_process_chat import InProcessChatConfig, InProcessChatHarness
from in_process_chat.tools import ERROR_PREFIX, MAX_ARGUMENT_DEPTH, Toolbox, parse_arguments

from rl.envs.chat_calls import tool_messages
from rl.config import ConfigError
from rl.envs.config import EnvConfig
from rl.envs.loading import EnvLoadError, load_environment
from rl.renderer import chat_renderer, renderer_config
from rl.tiny_model import build_tiny_model, build_tokenizer
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "environments"


@pytest.fixture
def fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tools") / "model"))


def test_auto_picks_verifiers_renderer_for_a_qwen3_hub_name():
    config, why = renderer_config("auto", "Qwen/Qwen3-0.6B")  # by name: nothing is downloaded
    assert isinstance(config, Qwen3RendererConfig) and "Qwen/Qwen3-0.6B" in why


def test_auto_reads_a_local_models_template(tiny, tmp_path):
    config, why = renderer_config("auto", tiny)
    assert config == DefaultRendererConfig(tool_parser="qwen3") and "<tool_call>" in why
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain.save_pretrained(tmp_path)
    assert renderer_config("auto", str(tmp_path))[0] == DefaultRendererConfig()


@pytest.mark.parametrize("hub_name, renderer", [
    ("Qwen/Qwen3-30B-A3B", "qwen3"),  # the MoE users run most: Qwen3's renderer, tools and thinking
    ("Qwen/Qwen3-235B-A22B", "qwen3"),
    ("meta-llama/Llama-3.2-3B-Instruct", "llama-3"),  # Llama 3's headers and its JSON tool calls
])
def test_auto_picks_each_familys_own_renderer_by_hub_name(hub_name, renderer):
    config, why = renderer_config("auto", hub_name)  # by name: nothing is downloaded
    assert config.name == renderer and hub_name in why


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama", "qwen2", "gemma3"])
def test_auto_reads_each_local_familys_template(arch, tmp_path):
    """A family's local directory (tiny-model --arch: each with the tokenizer's ChatML template and its <tool_call>
    tokens, as Qwen2.5's) renders with its own template and Qwen3's parser; a template that writes no tool calls
    (Gemma 3's) renders without tools, so a tool environment is refused at start-up (below)."""
    model = build_tiny_model(tmp_path / arch, arch=arch)
    assert renderer_config("auto", str(model))[0] == DefaultRendererConfig(tool_parser="qwen3")
    gemma_like = build_tokenizer()
    gemma_like.chat_template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == "
                                "'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}")
    gemma_like.save_pretrained(tmp_path / "gemma-like")
    assert renderer_config("auto", str(tmp_path / "gemma-like"))[0] == DefaultRendererConfig()


QWEN3_5_CHATS = [
    [{"role": "system", "content": " be brief "}, {"role": "user", "content": "first"},
     {"role": "assistant", "content": "one\n\ntwo"}, {"role": "user", "content": "second"}],
    [{"role": "user", "content": "add"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"function": {"name": "add", "arguments": {"a": 1, "b": [1, 2]}}},
         {"function": {"name": "add", "arguments": {"a": "x", "flag": True}}}]},
     {"role": "tool", "content": "3"}, {"role": "tool", "content": "4"},
     {"role": "assistant", "content": "<think>sum</think>\n\n7"}],
]
ADD_TOOL = [{"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}}}]


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "model", arch="qwen3_5"))


def test_auto_picks_qwen3_5s_renderer_for_a_local_checkpoint_thinking_as_its_template_answers(tiny_qwen3_5, tmp_path):
    """verifiers maps Qwen3.5 hub names only; a local directory is found by its model_type. The tiny model's
    template answers with thinking off (as Qwen3.5-0.8B's does), the renderer's own default for unknown names is on."""
    config, why = renderer_config("auto", tiny_qwen3_5)
    assert config == Qwen35RendererConfig(enable_thinking=False) and "qwen3_5_text" in why
    thinks = shutil.copytree(tiny_qwen3_5, tmp_path / "thinks")
    tokenizer = AutoTokenizer.from_pretrained(thinks)
    tokenizer.chat_template = tokenizer.chat_template.replace("else false", "else true")
    tokenizer.save_pretrained(thinks)
    assert renderer_config("auto", str(thinks))[0] == Qwen35RendererConfig(enable_thinking=True)
    assert renderer_config("auto", "Qwen/Qwen3.5-0.8B")[0].name == "qwen3.5"  # by hub name: nothing downloaded


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("chat", QWEN3_5_CHATS, ids=["multi-turn", "tool-calls"])
def test_the_qwen3_5_template_renders_as_its_renderer_token_for_token(chat, thinking):
    """SFT renders with the chat template, RL with the renderer: the model must see the same tokens from both."""
    tokenizer = build_tokenizer("qwen3_5")
    renderer = Qwen35Renderer(tokenizer, Qwen35RendererConfig(enable_thinking=thinking))
    for tools in (None, ADD_TOOL):
        for prompt in (chat[:-1], chat):
            from_template = tokenizer.apply_chat_template(prompt, tools=tools, enable_thinking=thinking,
                                                          add_generation_prompt=prompt is not chat)
            assert renderer.render_ids(prompt, tools=tools, add_generation_prompt=prompt is not chat) == list(
                from_template["input_ids"])


def test_qwen3_5s_xml_tool_calls_parse_and_blank_lines_survive():
    tokenizer = build_tokenizer("qwen3_5")
    renderer = Qwen35Renderer(tokenizer, Qwen35RendererConfig(enable_thinking=False))
    prompt = renderer.render_ids([{"role": "user", "content": "add"}], tools=ADD_TOOL, add_generation_prompt=True)
    reply = ("I add.\n\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2, 3]\n"
             "</parameter>\n</function>\n</tool_call><|im_end|>")
    parsed = renderer.parse_response(tokenizer.encode(reply, add_special_tokens=False), tools=ADD_TOOL,
                                     prompt_ids=prompt)
    assert parsed.content == "I add." and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": [2, 3]})]
    assert tokenizer.decode(tokenizer.encode("a\n\nb", add_special_tokens=False)) == "a\n\nb"


def test_explicit_renderers_and_bad_ones(tiny):
    assert renderer_config("qwen3", tiny)[0] == Qwen3RendererConfig()
    table = {"name": "default", "tool_parser": "qwen3"}
    assert renderer_config(table, tiny) == (DefaultRendererConfig(tool_parser="qwen3"), "as configured")
    with pytest.raises(ConfigError, match="model.renderer = 'no-such'"):
        renderer_config("no-such", tiny)
    with pytest.raises(ConfigError, match="model.renderer"):
        renderer_config({"name": "qwen3", "bogus": 1}, tiny)


def test_tool_environments_are_refused_a_renderer_without_tools(tiny):
    env = load_environment(EnvConfig(id="tool-calc", args={"num_examples": 2}))
    assert chat_renderer("auto", tiny, [env])[0].tool_parser == "qwen3"
    refusal = r"'tool-calc' \(toolsets CalcToolset\) serves tools.*default \(as configured"
    with pytest.raises(ConfigError, match=refusal):
        chat_renderer("default", tiny, [env])
    chat = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 2}))
    assert chat.toolsets == [] and chat_renderer("default", tiny, [chat])[0] == DefaultRendererConfig()


def test_a_harness_without_mcp_is_refused_for_a_tool_environment(fixtures_importable):
    env = load_environment(EnvConfig(id="toolset-env"))  # vf-init --add-tool's shape: a task-scoped toolset
    assert env.toolsets == ["kv"] and "harness 'in-process-chat'" in env.describe()
    with pytest.raises(EnvLoadError, match="'toolset-env'.*toolsets kv.*harness 'no-tools-harness' cannot offer tools"):
        load_environment(EnvConfig(id="toolset-env", harness={"id": "no-tools-harness"}))


def test_arguments_that_are_not_a_json_object_are_answered_as_errors():
    assert parse_arguments('{"a": 1}') == {"a": 1} and parse_arguments({"a": 1}) == {"a": 1}
    assert parse_arguments('{"a": ').startswith(ERROR_PREFIX + "the arguments are not valid JSON")
    assert parse_arguments("[1]") == ERROR_PREFIX + "the arguments must be a JSON object, not list"
    assert parse_arguments(None) == parse_arguments("") == {}
    deepest = '{"a": ' * MAX_ARGUMENT_DEPTH + "1" + "}" * MAX_ARGUMENT_DEPTH
    assert isinstance(parse_arguments(deepest), dict)
    assert parse_arguments('{"a": "' + "[{" * 100 + '\\"]"}') == {"a": "[{" * 100 + '"]'}  # brackets in strings


def nested_dict(depth: int) -> dict:
    inner: dict = {}
    for _ in range(depth):
        inner = {"a": inner}
    return inner


class NeverCalled:
    """An MCP connection the calls below must never reach: their arguments are refused first."""

    async def run(self, operation):
        raise AssertionError("a refused call reached the tool")


@pytest.mark.parametrize("arguments, why", [
    ('{"n": ' + "7" * 5000 + "}", "not valid JSON"),  # past Python's digit limit: ValueError
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),  # RecursionError, were it parsed
    ('{"a": "' + "x" * 10_000_000 + '"}', "longer than"),  # 10 MB
    ('{"a": ' + '{"b": ' * 100 + "1" + "}" * 101, "nested deeper than"),
    ("[1]", "must be a JSON object, not list"),
    ("null", "must be a JSON object, not NoneType"),
    (7, "must be a JSON object in a string, not int"),
    (["a"], "must be a JSON object in a string, not list"),
    (b'{"a": 1}', "must be a JSON object in a string, not bytes"),
    (nested_dict(100_000), "cannot be written as JSON (RecursionError)"),
    (nested_dict(100), "nested deeper than"),
])
def test_arguments_that_cannot_run_are_answered_as_errors_and_never_raise(arguments, why):
    result = parse_arguments(arguments)
    assert isinstance(result, str) and result.startswith(ERROR_PREFIX) and why in result
    toolbox = Toolbox([], {"add": ("calc", "add")}, {"calc": NeverCalled()}, 5.0)
    tool_call = {"id": "1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    assert asyncio.run(toolbox.call(tool_call)) == result


@pytest.mark.parametrize("tool_call, why", [
    (["add", "{}"], "a tool call is an object"),
    ({"function": "add"}, "a tool call is an object"),
    ({"function": {"name": ["add"], "arguments": "{}"}}, "the tool's name must be a string, not list"),
    ({"function": {"name": None}}, "the tool's name must be a string, not NoneType"),
    ({"function": {"name": "sub", "arguments": "{}"}}, "unknown tool 'sub'; the tools are add"),
])
def test_calls_of_the_wrong_shape_are_answered_as_errors(tool_call, why):
    toolbox = Toolbox([], {"add": ("calc", "add")}, {"calc": NeverCalled()}, 5.0)
    reply = asyncio.run(toolbox.call(tool_call))
    assert reply.startswith(ERROR_PREFIX) and why in reply


class StandInToolbox(Toolbox):
    """Answers `add` and refuses anything else, as the MCP-backed toolbox does."""

    def __init__(self):
        super().__init__([{"type": "function", "function": {"name": "add"}}], {"add": ("", "add")}, {}, 5.0)

    async def call(self, tool_call):
        name = tool_call["function"]["name"]
        if name != "add":
            return f"{ERROR_PREFIX}unknown tool {name!r}"
        arguments = parse_arguments(tool_call["function"]["arguments"])
        return str(arguments["a"] + arguments["b"])


def call(name: str, arguments: str, id_: str = "c") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_tool_loop_runs_calls_until_an_answer_or_the_budget(monkeypatch):
    replies = [
        {"content": None, "tool_calls": [call("add", '{"a": 2, "b": 3}', "1"), call("nope", "{}", "2")]},
        {"content": "5", "tool_calls": None},
    ]
    seen = []

    async def stand_in_chat(endpoint, secret, model, messages, tools=None):
        seen.append(([dict(m) for m in messages], tools))
        return replies[len(seen) - 1]

    monkeypatch.setattr(in_process_chat, "chat", stand_in_chat)
    harness = InProcessChatHarness(InProcessChatConfig(id="in-process-chat"))
    start = [{"role": "user", "content": "2 + 3?"}]
    assert asyncio.run(harness.tool_loop(StandInToolbox(), "e", "s", "m", list(start))) == "5"
    second_prompt, offered = seen[1]
    assert offered == [{"type": "function", "function": {"name": "add"}}]
    assert [(m["role"], m.get("content")) for m in second_prompt[-2:]] == [
        ("tool", "5"), ("tool", f"{ERROR_PREFIX}unknown tool 'nope'")
    ]
    assert tool_messages(second_prompt) == ["5", f"{ERROR_PREFIX}unknown tool 'nope'"]

    seen.clear()
    replies[1] = replies[0]  # the model keeps calling: the budget ends the rollout
    budget = InProcessChatHarness(InProcessChatConfig(id="in-process-chat", max_tool_calls=1))
    assert asyncio.run(budget.tool_loop(StandInToolbox(), "e", "s", "m", list(start))) == ""
    assert len(seen) == 2 and len(tool_messages(seen[1][0])) == 1


def test_calls_that_cannot_run_leave_the_rollout_going(monkeypatch):
    replies = [{"content": "", "tool_calls": [["add"], call("add", "7" * 5000)]}, {"content": "done"}]
    seen = []

    async def stand_in_chat(endpoint, secret, model, messages, tools=None):
        seen.append([dict(m) for m in messages])
        return replies[len(seen) - 1]

    monkeypatch.setattr(in_process_chat, "chat", stand_in_chat)
    toolbox = Toolbox([], {"add": ("calc", "add")}, {"calc": NeverCalled()}, 5.0)
    harness = InProcessChatHarness(InProcessChatConfig(id="in-process-chat"))
    assert asyncio.run(harness.tool_loop(toolbox, "e", "s", "m", [{"role": "user", "content": "?"}])) == "done"
    errors = tool_messages(seen[1])
    assert len(errors) == 2 and all(e.startswith(ERROR_PREFIX) for e in errors)
