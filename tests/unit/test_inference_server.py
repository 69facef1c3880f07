"""The generate route's response rewrite, without a server."""

import json

from rl.inference.server import add_token_strings


def test_token_strings_are_added_to_token_id_logprobs():
    body = {"choices": [{"logprobs": {"content": [{"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 9}]}]}}]}
    entry = json.loads(add_token_strings(json.dumps(body).encode()))["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:7" and entry["top_logprobs"][0]["token"] == "token_id:9"


def test_a_null_body_passes_unchanged():
    """vLLM answers `null` when the client went away mid-request; that must not raise in the server."""
    assert add_token_strings(b"null") == b"null"
