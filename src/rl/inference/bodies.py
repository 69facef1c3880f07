"""Request bodies as the gate (rl/inference/gate.py) reads them, bounded, and hands them on: replayed as read, or
with the served policy's cache salt added to a generation request."""

from __future__ import annotations

import json

MAX_GENERATION_BODY = 512 * 1024 * 1024  # read whole to be salted: a prompt of millions of token ids, with room


async def read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it passes `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # the client went away; the app sees an empty or partial body
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def salted(body: bytes, salt: str) -> bytes:
    """A JSON object's body with `"cache_salt": salt` as its last member, which JSON readers take over an earlier
    one (the client's, where it sent one: the policy's salt replaces it). A body that is no JSON object is left as it
    is, for vLLM to refuse. Appended as bytes: the body (a long prompt's token ids) is not parsed again."""
    end = body.rstrip()
    if not (end.startswith(b"{") and end.endswith(b"}")):
        return body
    inner = end[:-1].rstrip()
    separator = b"" if inner == b"{" else b","
    return inner + separator + b'"cache_salt":' + json.dumps(salt).encode() + b"}"


def with_length(scope: dict, length: int) -> dict:
    """The scope with its Content-Length set to `length` (a body the gate rewrote)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return scope | {"headers": [*headers, (b"content-length", str(length).encode())]}


def replay(body: bytes, receive):
    """A `receive` that gives the body already read, then defers to the connection's own."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
