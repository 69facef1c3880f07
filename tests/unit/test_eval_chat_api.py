"""`eval` against any OpenAI-compatible server: a fake one here (an HTTP server in a thread answering /v1/models
and /v1/chat/completions, no vLLM), reached through chat completions with the API key named by
client.api_key_var; and its clear failures: a refused key, a model the server does not serve, no server, a reply
too large or too slow (refused as it streams in)."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import verifiers.v1 as vf
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.errors import ProviderError

from rl.eval import main as eval_main
from rl.envs.rollouts import ChatClient
from tests.integration.launched import free_port

KEY = "sk-test-not-a-real-key"
MODEL = "fake-model"
FLOOD_BYTES = 100 << 20


class FakeOpenAI(BaseHTTPRequestHandler):
    """Serves MODEL to bearer KEY; its reply reverses the user's text, which solves reverse-text (or, `broken`,
    every completion fails)."""

    requests: list[dict] = []
    broken = False
    flood: str | None = None  # "huge", "announced" or "trickle": a reply that is too large or too slow
    floods: list[tuple[int, bool]] = []  # per flood: bytes sent, and whether the client closed before the end

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
        if FakeOpenAI.flood:
            return self.send_flood(FakeOpenAI.flood)
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

    def send_flood(self, flood: str) -> None:
        """A chat completion whose text is 100 MiB (its length announced, or not: read until the connection closes),
        or 1000 bytes trickled at 20 bytes/s."""
        size, step, pause = (1000, 1, 0.05) if flood == "trickle" else (FLOOD_BYTES, 1 << 16, 0.0)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if flood != "huge":
            self.send_header("Content-Length", str(size))
        self.end_headers()
        sent = 0
        try:
            self.wfile.write(b'{"id": "x", "object": "chat.completion", "choices": [{"message": {"content": "')
            while sent < size:
                self.wfile.write(b"a" * step)
                self.wfile.flush()
                sent += step
                time.sleep(pause)
        except OSError:  # the client closed the connection
            pass
        FakeOpenAI.floods.append((sent, sent < size))

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def fake_openai():
    FakeOpenAI.requests, FakeOpenAI.broken, FakeOpenAI.flood, FakeOpenAI.floods = [], False, None, []
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


def wait_for_floods(count: int) -> list[tuple[int, bool]]:
    """The floods the server sent, once `count` of them ended (their handler threads see the client close)."""
    end = time.monotonic() + 10
    while len(FakeOpenAI.floods) < count and time.monotonic() < end:
        time.sleep(0.05)
    return FakeOpenAI.floods


@pytest.mark.parametrize("flood, refusal", [
    ("huge", "passed .* bytes, over client.max_reply_bytes = 1048576; refused unread past the bound"),
    ("announced", f"announced {FLOOD_BYTES} bytes, over client.max_reply_bytes = 1048576"),
    ("trickle", "was not read whole within rollout.timeout_s = 2s of its request"),
])
def test_chat_replies_too_large_or_too_slow_are_refused_as_they_stream(fake_openai, monkeypatch, flood, refusal):
    """verifiers' eval client, as eval builds it: the reply is refused within the deadline, naming the bound, and
    never read whole (the server sees the connection closed)."""
    monkeypatch.setenv("FAKE_OPENAI_KEY", KEY)
    FakeOpenAI.flood = flood
    chat = ChatClient(fake_openai, MODEL, "FAKE_OPENAI_KEY", max_reply_bytes=1 << 20, reply_deadline_s=2.0)

    async def ask():
        client = vf.resolve_client(chat.client_config())
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            await client.get_response(ChatDialect(), body, vf.SamplingConfig())
        finally:
            await client.close()

    start = time.monotonic()
    with pytest.raises(ProviderError, match=refusal):
        asyncio.run(ask())
    assert time.monotonic() - start < 2.0 + 1.5
    ((sent, closed_early),) = wait_for_floods(1)
    assert closed_early and sent < FLOOD_BYTES / 4


def test_eval_fails_a_rollout_whose_reply_is_too_large_and_names_the_bound(fake_openai, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setenv("FAKE_OPENAI_KEY", KEY)
    FakeOpenAI.flood = "huge"
    start = time.monotonic()
    argv = eval_argv(fake_openai, tmp_path / "a", "--client.max-reply-bytes", "65536", "--rollout.timeout-s", "60",
                     "--rollout.max-retries", "0")
    code, err = run_eval(argv, capsys)
    assert code == 1 and "over client.max_reply_bytes = 65536; refused unread past the bound" in err
    assert time.monotonic() - start < 30  # six 100 MiB replies, each refused after its first 64 KiB
    floods = wait_for_floods(6)
    assert len(floods) == 6 and all(closed_early and sent < FLOOD_BYTES / 4 for sent, closed_early in floods)


def test_errors_about_a_server_never_print_the_password_in_its_url():
    import logging

    from rl.eval.serving import EvalError, check_served, wait_for_models

    root = "http://user:s3cret@127.0.0.1:9/v1"  # nothing listens on port 9
    with pytest.raises(EvalError) as refused:
        wait_for_models(root, "NO_SUCH_KEY_VAR", timeout_s=0.3)
    assert "s3cret" not in str(refused.value) and "user:" in str(refused.value)
    with pytest.raises(EvalError) as refused:
        check_served(root, "m", ["other"], logging.getLogger("test"))
    assert "s3cret" not in str(refused.value)
