"""The samples section of `rl report`: the rollouts the orchestrator wrote as text (samples/step_k.jsonl,
orchestrator/samples_text.py) for the newest steps, newest first, each a collapsed block with its environment,
pick, reward, components and metrics, and its prompt and turns; a search box filters them as you type. Everything
shown is escaped; a line that is not a sample record is named and left out, the rest is shown."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from rl.metrics_file import json_line
from rl.protocol import RunPaths

STEPS_SHOWN = 50  # the newest steps with samples; older files stay on disk
MAX_FILE_BYTES = 16 * 2**20
SEARCH = ("<script>document.getElementById('sample-search').oninput=function(e){var q=e.target.value.toLowerCase();"
          "document.querySelectorAll('#samples details').forEach(function(d){"
          "d.style.display=d.textContent.toLowerCase().indexOf(q)<0?'none':''})}</script>")


def sample_files(paths: RunPaths) -> list[tuple[int, Path]]:
    directory = paths.samples(0).parent
    found = [(int(m.group(1)), p) for p in directory.glob("step_*.jsonl")
             if (m := re.fullmatch(r"step_(\d{1,9})\.jsonl", p.name))] if directory.is_dir() else []
    return sorted(found, reverse=True)


def read_samples(paths: RunPaths) -> tuple[list[dict], list[str], int]:
    """The newest steps' sample records, one line for each line or file left out, and how many steps have samples."""
    files, records, notes = sample_files(paths), [], []
    for _, path in files[:STEPS_SHOWN]:
        if path.stat().st_size > MAX_FILE_BYTES:
            notes.append(f"samples/{path.name}: over {MAX_FILE_BYTES} bytes, left out")
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            record, why = parse_sample(line)
            if why:
                notes.append(f"samples/{path.name} line {number}: {why}")
            else:
                records.append(record)
    return records, notes, len(files)


def parse_sample(line: bytes) -> tuple[dict | None, str | None]:
    value, why = json_line(line)
    if why:
        return None, why
    if not isinstance(value, dict) or not isinstance(value.get("turns", []), list):
        return None, "not a sample record (an object with a list of turns)"
    return value, None


def text(value, limit: int = 100_000) -> str:
    return html.escape(str(value)[:limit])


def sample_block(record: dict) -> str:
    reward = record.get("reward")
    head = " · ".join(text(record.get(k), 200) for k in ("step", "env", "pick"))
    head += f" · reward {reward:.4g}" if isinstance(reward, (int, float)) and not isinstance(reward, bool) else ""
    head += f" · task {text(record.get('task_id'), 200)}"
    facts = {k: record.get(k) for k in ("rewards", "metrics", "num_turns", "truncated", "policy_versions",
                                        "prompt_tokens", "completion_tokens")}
    rows = "".join(f"<tr><th>{text(k)}</th><td>{text(json.dumps(v) if isinstance(v, (dict, list)) else v, 2000)}"
                   "</td></tr>" for k, v in facts.items())
    turns = "".join(f"<pre>[{text(t.get('role'), 50)}] {text(t.get('text'))}</pre>" if isinstance(t, dict)
                    else f"<pre>{text(t)}</pre>" for t in record.get("turns", []))
    return (f"<details><summary>{head}</summary><table>{rows}</table>"
            f"<pre>[prompt] {text(record.get('prompt'))}</pre>{turns}</details>")


def samples_section(paths: RunPaths) -> str:
    records, notes, steps = read_samples(paths)
    if not steps:
        return "<h2>Samples</h2><p>no samples/ here (orchestrator.samples.picks = [] writes none)</p>"
    shown = min(steps, STEPS_SHOWN)
    left_out = f"<p>Left out: {html.escape('; '.join(notes[:50]))}</p>" if notes else ""
    return (f"<h2>Samples</h2><p>{len(records)} rollouts of the newest {shown} of {steps} steps with samples, newest "
            f'first. Search: <input id="sample-search" type="search"></p>{left_out}'
            f'<div id="samples">{"".join(sample_block(r) for r in records)}</div>{SEARCH}')
