"""The generate route's response rewrite and the server's private IPC directory, without a server."""

import json
import os
import tempfile
from pathlib import Path

import pytest

from rl.inference.server import add_token_strings, private_ipc_dir


def test_token_strings_are_added_to_token_id_logprobs():
    body = {"choices": [{"logprobs": {"content": [{"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 9}]}]}}]}
    entry = json.loads(add_token_strings(json.dumps(body).encode()))["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:7" and entry["top_logprobs"][0]["token"] == "token_id:9"


def test_a_null_body_passes_unchanged():
    """vLLM answers `null` when the client went away mid-request; that must not raise in the server."""
    assert add_token_strings(b"null") == b"null"


def test_vllm_ipc_sockets_get_a_directory_removed_at_exit(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with pytest.raises(RuntimeError), private_ipc_dir():
        ipc = Path(os.environ["VLLM_RPC_BASE_PATH"])
        (ipc / "engine-socket").touch()  # a file vLLM would leave behind
        raise RuntimeError("the server failed")
    assert ipc.name.startswith("vllm-") and not ipc.exists()
    assert "VLLM_RPC_BASE_PATH" not in os.environ


def test_a_user_chosen_ipc_path_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    with private_ipc_dir():
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
    assert tmp_path.is_dir() and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)


def test_a_temp_directory_too_deep_for_a_socket_path_keeps_vllms_default(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_ipc_dir():
        assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []
