"""metrics.jsonl: one JSON object per line, appended by every process (`RunPaths.metrics`) and read back whole; and
one JSON line of a file anyone may have written, decoded or said why not (`json_line`)."""

from __future__ import annotations

import json
import os


def append_metrics(paths, record: dict) -> None:
    """Append one line to `paths.metrics` (`paths`: a `rl.protocol.RunPaths`); O_APPEND writes of one short line do
    not interleave between processes."""
    line = (json.dumps(record) + "\n").encode()
    paths.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_metrics(paths) -> list[dict]:
    """Every record of `paths.metrics`, in the order written; none before the first. A last line without its newline
    is one being written while this reads (a running run's file: `rl report`), left for a later read."""
    if not paths.metrics.exists():
        return []
    text = paths.metrics.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def json_line(line: bytes) -> tuple[object, str | None]:
    """A JSON line's value, or None and why it is none (not UTF-8, nested too deep, not JSON): for reports that
    render what they can of files they did not write."""
    try:
        return json.loads(line.decode()), None
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except RecursionError:
        return None, "nested too deep"
    except ValueError as e:  # not JSON, or an integer of more digits than Python converts
        return None, f"not JSON ({str(e)[:80]})"
