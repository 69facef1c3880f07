"""`eval` against any OpenAI-compatible server: a fake one here (an HTTP server in a thread answering /v1/models
and /v1/chat/completions, no vLLM), reached through chat completions with the API key named by
client.api_key_var; and its clear failures: a refused key, a model the server does not serve, no server."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl.eval import main as eval_main
from tests.integration.launched import free_port

KEY = "sk-test-not-a-real-key"
MODEL = "fake-model"


class FakeOpenAI(BaseHTTPRequestHandler):
    """Serves MODEL to bearer KEY; its reply reverses the user's text, which solves reverse-text (or, `broken`,
    every completion fails)."""

    requests: list[dict] = []
    broken = False

    def do_GET(self):
        if self.path != "/v1/models":
            return self.reply(404, {"error": "not found"})
        if self.authorized():
            self.reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            return self.reply(404, {"error": "not found"})
        if not self.authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append(body)
        if FakeOpenAI.broken:
            return self.reply(500, {"error": {"message": "the engine is dead"}})
        text = body["messages"][-1]["content"][::-1]
        self.reply(200, {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
        })

    def authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self.reply(401, {"error": {"message": "Incorrect API key provided"}})
        return False

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def fake_openai():
    FakeOpenAI.requests, FakeOpenAI.broken = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def eval_argv(url: str, out, *extra: str) -> list[str]:
    env = [{"id": "reverse-text", "args": {"num_examples": 3}}]
    return ["--model.name", MODEL, "--client.base-url", url, "--client.api-key-var", "FAKE_OPENAI_KEY",
            "--env", json.dumps(env), "--rollouts-per-example", "2", "--sampling.temperature", "0.7",
            "--sampling.max-tokens", "16", "--sampling.seed", "5", "--output-dir", str(out), *extra]


def run_eval(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        eval_main.main(argv)
    return exit_info.value.code, capsys.readouterr().err


def test_eval_samples_any_openai_server_through_chat_completions(fake_openai, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OPENAI_KEY", KEY)
    out = tmp_path / "eval"
    eval_main.main(eval_argv(fake_openai, out))
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 6 and {r["task_index"] for r in records} == {0, 1, 2}
    for r in records:
        (prompt,), (reply,) = r["prompt"], r["completion"]
        assert prompt["role"] == "user" and reply == {"role": "assistant", "content": prompt["content"][::-1]}
        assert r["reward"] == 1.0 and r["passed"] and r["metrics"]["exact_match"] == 1.0
        assert r["completion_tokens"] == 5 and r["num_turns"] == 1
    env = summary["envs"]["reverse-text"]
    assert (env["tasks"], env["rollouts"], env["dropped"], env["reward"]) == (3, 6, 0, 1.0)
    assert env["pass@1"] == env["pass@2"] == env["avg@2"] == 1.0
    assert summary["api"] == "chat" and summary["overall"]["completion_len"] == 5
    assert len(FakeOpenAI.requests) == 6
    assert all(b["model"] == MODEL and b["temperature"] == 0.7 and b["max_tokens"] == 16 for b in FakeOpenAI.requests)
    assert sorted(b["seed"] for b in FakeOpenAI.requests) == [5, 5, 5, 6, 6, 6]  # rollout j of a group: seed + j
    assert KEY not in (out / "configs" / "eval.toml").read_text()
    assert "reverse-text" in capsys.readouterr().out  # the table


def test_refused_key_wrong_model_no_server_and_failing_rollouts_are_named(fake_openai, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OPENAI_KEY", "sk-wrong")
    code, err = run_eval(eval_argv(fake_openai, tmp_path / "a"), capsys)
    assert code == 1 and f"server {fake_openai} refused the API key in $FAKE_OPENAI_KEY (401" in err

    monkeypatch.setenv("FAKE_OPENAI_KEY", KEY)
    code, err = run_eval(eval_argv(fake_openai, tmp_path / "b", "--client.served-model", "gpt-nope"), capsys)
    assert code == 1 and f"server {fake_openai} does not serve model 'gpt-nope'; it serves {MODEL}" in err

    nowhere = f"http://127.0.0.1:{free_port()}"
    code, err = run_eval(eval_argv(nowhere, tmp_path / "c", "--client.startup-timeout-s", "2"), capsys)
    assert code == 1 and f"server {nowhere}/v1 did not answer GET /models within 2s" in err
    assert not FakeOpenAI.requests

    FakeOpenAI.broken = True
    code, err = run_eval(eval_argv(fake_openai, tmp_path / "d", "--rollout.max-retries", "0"), capsys)
    assert code == 1 and f"every rollout failed on {fake_openai} (model '{MODEL}', api 'chat'" in err
    assert "the engine is dead" in err
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["envs"]["reverse-text"]["dropped"] == 6 and len(summary["envs"]["reverse-text"]["errors"]) == 3


def test_the_api_key_is_named_by_a_set_variable_never_given(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FAKE_OPENAI_KEY", raising=False)
    code, err = run_eval(eval_argv("http://127.0.0.1:1/v1", tmp_path / "a"), capsys)
    assert code == 2 and "the environment variable FAKE_OPENAI_KEY is not set" in err
    code, err = run_eval(eval_argv("http://127.0.0.1:1/v1", tmp_path / "b", "--client.api-key-var", KEY), capsys)
    assert code == 2 and "not the key" in err and KEY not in err
