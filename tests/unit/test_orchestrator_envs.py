"""The offline environment packages: tasks from a seed, the env's replies, the tool protocol, and
clear start-up errors for unknown ids and bad args."""

import pytest

from guess_number import feedback, parse_guess
from rl.orchestrator.rollouts import load_environment
from tool_calc import find_call, last_number, run_call


def test_guess_number_tasks_and_feedback():
    env = load_environment("guess-number", {"num_examples": 5, "low": 1, "high": 10, "seed": 3})
    again = load_environment("guess-number", {"num_examples": 8, "low": 1, "high": 10, "seed": 3})
    targets = [t.data.target for t in env.tasks]
    assert targets == [t.data.target for t in again.tasks][:5]  # task i depends only on (seed, i)
    assert all(1 <= t <= 10 for t in targets)
    assert parse_guess("maybe 7?") == 7 and parse_guess("no idea") is None
    assert [feedback(3, 5), feedback(8, 5), feedback(5, 5), feedback(None, 5)] == [
        "higher", "lower", "correct", "Reply with a number."
    ]


def test_tool_calc_tools_run_in_process():
    env = load_environment("tool-calc", {"num_examples": 3, "seed": 1})
    task = env.tasks[0].data
    assert "add(a: int, b: int)" in task.system_prompt and task.prompt.startswith("What is (")
    call = find_call('I will add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert run_call(call) == "5"
    assert run_call('{"name": "multiply", "arguments": {"a": 4, "b": 6}}') == "24"
    assert run_call('{"name": "divide", "arguments": {"a": 4, "b": 2}}').startswith("error: KeyError")
    assert find_call("just 12") is None and last_number("it is 3 then 12") == 12


@pytest.mark.parametrize(
    ("env_id", "args", "named"),
    [
        ("no-such-env", {}, "no-such-env"),
        ("guess-number", {"low": 5, "high": 5}, "low (5) must be < high (5)"),
        ("tool-calc", {"bogus": 1}, "bogus"),
    ],
)
def test_bad_environments_fail_at_start_up_naming_the_problem(env_id, args, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_environment(env_id, args)


def test_interception_servers_hold_few_rollouts_unless_overridden():
    assert load_environment("reverse-text", {"num_examples": 2}).env.config.interception.multiplex == 8
    own = {"interception": {"type": "elastic", "multiplex": 2}}
    assert load_environment("reverse-text", {"num_examples": 2}, own).env.config.interception.multiplex == 2
