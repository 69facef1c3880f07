"""`rl report <run-dir>`: <run-dir>/report.html, one self-contained page (plots inline as PNG, no external URL) of
where a run's time goes: reward and eval reward, loss, tokens/s, staleness, each side's wait, rollouts in flight and
the engines' KV cache per step, with the run's progress, summary, samples (launcher/report_samples.py) and configs
(secrets masked). Built from
metrics.jsonl and configs/ alone, read only: safe while the run is going (a record still being written is left out).
The launcher writes it at the end of every run too (supervisor.py)."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import sys
import time
import tomllib
from pathlib import Path

import tomli_w

from rl.atomic import atomic_write_text
from rl.config import without_secrets
from rl.launcher.report import duration, per_step, summary_of, time_left_s
from rl.launcher.report_samples import samples_section
from rl.metrics_file import json_line
from rl.protocol import RunPaths

USAGE = """usage: rl report <run-dir>

Write <run-dir>/report.html: the run's plots per step, progress, summary and configs on one self-contained page.
Safe to run while the run is going."""

KV_CACHE = re.compile(r"kv_cache", re.I)
PREEMPTIONS = re.compile(r"preempt", re.I)
CALL_TIMES = re.compile(r"^(call|trainer)_s/")  # rl serve-api: each kind of request's time, and the trainer's part
NAMES = {KV_CACHE: "the engines' KV cache usage", PREEMPTIONS: "preemptions", CALL_TIMES: "the Tinker API's calls"}
MAX_SERIES = 12  # per plot: a pattern may match a key per server
PLOTTABLE = 1e100  # a larger number is no measurement, and overflows a plot's axis arithmetic
MAX_STEP = 10**9
MAX_NOTES = 20  # bad metrics lines said on the terminal; the report lists them all

# (title, y label, series): a series is (process, key) or (process, pattern): every numeric key of that process's
# records the pattern finds (None: any process's), e.g. the engines' per-server keys.
PLOTS: tuple[tuple[str, str, tuple[tuple[str | None, str | re.Pattern], ...]], ...] = (
    ("Reward", "mean reward", (("orchestrator", "reward"), ("orchestrator", "eval/reward"))),
    ("Trainer loss", "loss", (("trainer", "loss"),)),
    ("Tokens per second", "tokens/s", (("orchestrator", "tokens_per_s"), ("trainer", "tokens_per_s"))),
    ("Staleness", "policy steps behind", (("orchestrator", "staleness"), ("orchestrator", "off_policy/max"),
                                          ("orchestrator", "off_policy/mean"))),
    ("Importance ratios", "pi_theta / pi_sampled", (("trainer", "ratio_p1"), ("trainer", "ratio_p50"),
                                                    ("trainer", "ratio_p99"), ("trainer", "mismatch_corr"))),
    ("Not trained", "share", (("trainer", "masked_frac"), ("trainer", "masked_seq_frac"),
                              ("orchestrator", "off_policy/discarded_tokens"))),
    ("Length of trained rollouts", "sampled tokens", (("orchestrator", "completion_len"),
                                                      ("orchestrator", "off_policy/trained_len"))),
    ("Each side's wait", "seconds per step", (("orchestrator", "time/wait_for_policy"),
                                              ("trainer", "time/wait_for_batch"))),
    ("Rollouts in flight", "rollouts", (("orchestrator", "rollouts_in_flight"), ("orchestrator", "concurrency/cap"))),
    ("KV cache usage", "KV cache usage", ((None, KV_CACHE),)),
    ("Preemptions", "requests preempted", ((None, PREEMPTIONS),)),
    ("Tinker API calls", "seconds (the step's last of each kind)", (("service", CALL_TIMES),)),
)


class NoRun(Exception):
    """The directory holds no run to report (what is missing is said)."""


def report_path(paths: RunPaths) -> Path:
    return paths.root / "report.html"


def read_run(paths: RunPaths) -> tuple[list[dict], list[str]]:
    """The run's complete records, and one line for each metrics line left out or cut (naming the line and why);
    NoRun, naming the path and what is missing, where there is no record to show."""
    root = paths.root
    if not root.is_dir():
        raise NoRun(f"{root} is not a directory")
    if not paths.metrics.exists():
        if paths.configs.is_dir():
            raise NoRun(f"{root}: the run has recorded no step yet ({paths.metrics} does not exist)")
        raise NoRun(f"{root} holds no run: neither {paths.metrics.name} nor {paths.configs.name}/ is there")
    data = paths.metrics.read_bytes()
    records, notes = [], []
    for number, line in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), 1):  # a last line being written waits
        record, why = parse_record(line) if line.strip() else (None, None)
        if why:
            notes.append(f"{paths.metrics.name} line {number}: {why}")
        if record is not None:
            records.append(record)
    if not records:
        raise NoRun(f"{paths.metrics} holds no complete step record yet" + (f" ({notes[0]})" if notes else ""))
    return records, notes


def parse_record(line: bytes) -> tuple[dict | None, str | None]:
    """A metrics line as the report can use it (None: none), and what was wrong with it (None: nothing). Numbers no
    plot can hold (not finite, beyond PLOTTABLE) are left out of their record; a record without a step (a whole
    number below MAX_STEP) and a process name is no step record."""
    value, why = json_line(line)
    if why:
        return None, why
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not an object"
    step = value.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and isinstance(value.get("process"), str)):
        return None, None
    if not 0 <= step < MAX_STEP:
        return None, f"step {str(step)[:20]} out of range"
    unplottable = [k for k, v in value.items() if isinstance(v, (int, float)) and not plottable(v)]
    for key in unplottable:
        del value[key]
    return value, f"{', '.join(unplottable[:4])} not a plottable number, left out" if unplottable else None


def plottable(value: int | float) -> bool:
    try:
        return math.isfinite(float(value)) and abs(float(value)) <= PLOTTABLE
    except OverflowError:  # an integer beyond float's range
        return False


def run_configs(paths: RunPaths) -> dict[str, str]:
    """Each resolved TOML under configs/ (relative name: text) with every secret masked: rl.toml was written so, but
    each process's own file holds its secrets (it reads them back), so each is parsed and masked by name as every
    printed config is (rl/config_secrets.py), URLs' passwords too. A file that does not parse is not shown."""
    shown = {}
    for path in sorted(paths.configs.rglob("*.toml")) if paths.configs.is_dir() else []:
        name = str(path.relative_to(paths.configs))
        try:
            shown[name] = tomli_w.dumps(without_secrets(tomllib.loads(path.read_text()), drop=False))
        except (OSError, ValueError) as e:
            shown[name] = f"(not shown: {type(e).__name__})"
    return shown


def launch_time(paths: RunPaths, records: list[dict]) -> float:
    """When the latest launch started: configs/rl.toml is written then (each host's, on several), else the first
    record's time."""
    written = [p.stat().st_mtime for p in paths.configs.rglob("rl.toml")] if paths.configs.is_dir() else []
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return max(written) if written else min(times, default=time.time())


def configured_max_steps(paths: RunPaths) -> int | None:
    """max_steps of the resolved configs: rl.toml's trainer section, else trainer.toml or orchestrator.toml."""
    if not paths.configs.is_dir():
        return None
    for pattern, section in (("rl.toml", "trainer"), ("trainer.toml", None), ("orchestrator.toml", None)):
        for path in sorted(paths.configs.rglob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                data = tomllib.loads(path.read_text())
            except (OSError, ValueError):
                continue
            value = (data.get(section) or {}).get("max_steps") if section else data.get("max_steps")
            if isinstance(value, int):
                return value
    return None


def numeric_keys(records: list[dict]) -> dict[str, set[str]]:
    """Per process, the keys its records give a number (a plot's series)."""
    keys: dict[str, set[str]] = {}
    for r in records:
        numeric = {k for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "time"}
        keys.setdefault(str(r["process"]), set()).update(numeric)
    return keys


def series(records: list[dict], keys: dict[str, set[str]], specs) -> tuple[dict[str, dict[int, float]], list[str]]:
    """Each spec's points per step (label: points), and what no record holds (for the list of what was not logged);
    `keys`: numeric_keys(records)."""
    found, missing = {}, []
    for process, key in specs:
        if process is not None and process not in keys:  # a process this run has none of (rl's service, its
            continue  # orchestrator under rl serve-api): nothing to draw or to miss
        where = [process] if process is not None else sorted(keys)
        matched = [(p, k) for p in where for k in sorted(keys.get(p, ()))
                   if (k == key if isinstance(key, str) else key.search(k))][:MAX_SERIES]
        for p, k in matched:
            found[f"{p} {k}"] = per_step(records, p, k)
        if not matched:
            missing.append(f"{process}: {key}" if isinstance(key, str) else f"{NAMES[key]} (a key matching "
                                                                            f"/{key.pattern}/)")
    return found, missing


def plot_png(title: str, ylabel: str, lines: dict[str, dict[int, float]]) -> str:
    """The plot as base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    for label, points in lines.items():
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], marker="o" if len(steps) <= 60 else None, markersize=3,
                linewidth=1.2, label=label)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def run_summary(paths: RunPaths, records: list[dict], elapsed_s: float, max_steps: int | None,
                since: float) -> tuple[dict, str]:
    """summary.json where it is newer than the last record (the end of the run wrote it), else computed now."""
    last = max((r["time"] for r in records if isinstance(r.get("time"), (int, float))), default=None)
    try:
        if paths.summary.exists() and (last is None or paths.summary.stat().st_mtime >= last):
            summary = json.loads(paths.summary.read_text())
            if isinstance(summary, dict):
                return summary, paths.summary.name
    except (OSError, ValueError, RecursionError):
        pass
    return summary_of(records, elapsed_s, max_steps, since), "computed from metrics.jsonl"


def shown_value(key: str, value) -> str:
    if key.endswith("_s") and isinstance(value, (int, float)):
        return f"{duration(value)} ({value:.0f} s)"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "none" if value is None else str(value)


def table(rows: dict) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(shown_value(str(k), v))}</td></tr>"
                    for k, v in rows.items())
    return f"<table>{cells}</table>"


STYLE = ("body{font-family:sans-serif;max-width:60em;margin:1em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse}th,td{text-align:left;padding:2px 12px 2px 0;font-weight:normal}"
         "th{color:#555}img{max-width:100%}pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}"
         "figure{margin:1em 0}figcaption{color:#555;font-size:12px}")


def render(paths: RunPaths, records: list[dict], now: float, notes: list[str] = ()) -> str:
    max_steps = configured_max_steps(paths)
    launched = launch_time(paths, records)
    last = max((r["time"] for r in records if isinstance(r.get("time"), (int, float))), default=launched)
    elapsed = max(last - launched, 0.0)
    trained = [r["step"] for r in records if r.get("process") == "trainer"]
    left = time_left_s(records, max_steps, launched) if max_steps else None
    progress = {
        "steps trained": f"{max(trained) + 1 if trained else 0}" + (f" of {max_steps}" if max_steps else ""),
        "elapsed": f"{duration(elapsed)} (from this launch to its last record)",
        "time left": ("not known: no max_steps in configs/" if not max_steps
                      else "no estimate before 2 trainer steps" if left is None
                      else "none: max_steps reached" if left == 0 else f"~{duration(left)}"),
        "last record": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last))
                       + f", {duration(max(now - last, 0))} before this report",
    }
    summary, source = run_summary(paths, records, elapsed, max_steps, launched)
    figures, missing, keys = [], [], numeric_keys(records)
    for title, ylabel, specs in PLOTS:
        lines, absent = series(records, keys, specs)
        missing += absent
        if lines:
            caption = ", ".join(html.escape(label) for label in lines)
            slug = re.sub(r"\W+", "-", title.lower()).strip("-")
            figures.append(f'<figure id="{slug}"><img alt="{html.escape(title)}" '
                           f'src="data:image/png;base64,{plot_png(title, ylabel, lines)}">'
                           f"<figcaption>{caption}</figcaption></figure>")
    configs = "".join(f"<details><summary>configs/{html.escape(name)}</summary><pre>{html.escape(text)}</pre>"
                      "</details>" for name, text in run_configs(paths).items()) or "<p>no configs/ here</p>"
    not_logged = f"<p>Not logged in this run: {html.escape('; '.join(missing))}</p>" if missing else ""
    not_logged += f"<p>Left out of the plots: {html.escape('; '.join(notes))}</p>" if notes else ""
    name = html.escape(paths.root.name)
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>rl report: {name}</title>'
            f"<style>{STYLE}</style></head><body><h1>rl report: {name}</h1>"
            f"<p>{html.escape(str(paths.root))}, {len(records)} records; written {generated}</p>"
            f"<h2>Progress</h2>{table(progress)}"
            f"<p>Time left: the steps not yet trained times the mean interval between the trainer's last step "
            f"records of this launch; none before two.</p>"
            f"<h2>Summary</h2><p>{html.escape(source)}</p>{table(summary)}"
            f"<h2>Per step</h2>{''.join(figures)}{not_logged}{samples_section(paths)}"
            f"<h2>Config</h2><p>secrets masked</p>{configs}</body></html>\n")


def write_report(paths: RunPaths, say=lambda line: None) -> Path:
    """Write report.html (whole or not at all: a browser reloading it never sees half); NoRun where there is no run.
    `say` gets a line for each metrics line left out or cut."""
    records, notes = read_run(paths)
    for note in notes[:MAX_NOTES]:
        say(note)
    if len(notes) > MAX_NOTES:
        say(f"and {len(notes) - MAX_NOTES} more lines (listed in the report)")
    out = report_path(paths)
    atomic_write_text(out, render(paths, records, time.time(), notes))
    return out


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        out = write_report(RunPaths(Path(argv[0]).absolute()),
                           say=lambda line: print(f"rl report: {line}", file=sys.stderr))
    except NoRun as e:
        print(f"rl report: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"rl report: wrote {out}")
