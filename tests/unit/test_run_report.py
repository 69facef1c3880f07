"""Where a run's time goes: the time left to max_steps (step lines, summary) and `rl report`'s page, from a synthetic
metrics.jsonl. The page of a real run: tests/integration/test_run.py."""

import base64
import os
import re
import time

import pytest

from rl.launcher.main import main as rl_main
from rl.launcher.report import duration, format_summary, seconds_per_step, summarize, time_left_s
from rl.launcher.run_report import NoRun, report_path, write_report
from rl.launcher.supervisor import Supervisor
from rl.protocol import RunPaths, append_metrics

PLOTS = ("Reward", "Trainer loss", "Tokens per second", "Staleness", "Importance ratios", "Not trained",
         "Length of trained rollouts", "Each side&#x27;s wait", "Rollouts in flight",
         "KV cache usage", "Preemptions", "Tinker API calls")


def trainer(step: int, at: float, **more) -> dict:
    return {"process": "trainer", "step": step, "time": at, **more}


# ---- the time left ----


def test_the_pace_is_the_mean_interval_of_the_last_steps_and_none_before_two():
    assert seconds_per_step([]) is None
    assert seconds_per_step([100.0]) is None
    assert seconds_per_step([100.0, 130.0]) == 30.0
    # a slow first step (model load, compile) drops out of the window of the last 5 intervals
    assert seconds_per_step([0.0, 500.0, 510.0, 520.0, 530.0, 540.0, 550.0]) == 10.0


def test_time_left_is_the_steps_not_trained_times_the_pace():
    records = [trainer(s, 1000.0 + 20 * s) for s in range(4)] + [{"process": "orchestrator", "step": 5, "time": 2e3}]
    assert time_left_s(records, max_steps=10) == 6 * 20.0  # steps 4..9 left, 20 s apart
    assert time_left_s(records[:1], max_steps=10) is None  # one step: no estimate
    assert time_left_s([], max_steps=10) is None
    assert time_left_s([trainer(s, 20.0 * s) for s in range(10)], max_steps=10) == 0.0  # max_steps reached
    # resumed: the pause between launches (steps 0-1 then 2-4, an hour later) is no step's time
    resumed = [trainer(0, 0.0), trainer(1, 10.0)] + [trainer(s, 3600.0 + 10 * s) for s in (2, 3, 4)]
    assert time_left_s(resumed, max_steps=10, since=3600.0) == 5 * 10.0
    assert time_left_s(resumed[:3], max_steps=10, since=3600.0) is None  # one step of this launch


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (4.4, 65, 7380, 2 * 86400 + 3 * 3600 + 59)] == ["4s", "1m05s", "2h03m", "2d03h"]


def test_every_step_line_says_the_elapsed_time_and_from_the_second_step_the_time_left(tmp_path, capsys):
    paths = RunPaths(tmp_path)
    supervisor = Supervisor(paths, tail_lines=5, shutdown_timeout_s=5, max_steps=10)
    supervisor.started = time.monotonic() - 65
    append_metrics(paths, {"process": "orchestrator", "step": 0, "time": 95.0, "reward": 0.5})
    append_metrics(paths, trainer(0, 100.0, loss=1.0))
    supervisor._show_new_metrics()
    append_metrics(paths, trainer(1, 110.0, loss=0.9))
    append_metrics(paths, trainer(2, 120.0, loss=0.8))
    supervisor._show_new_metrics()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(re.match(r"rl: step \d (trainer|orchestrator) ", line) for line in lines)
    assert all(re.search(r" \[1m0[5-9]s elapsed, ", line) for line in lines), lines
    assert "no estimate" in lines[0] and "no estimate" in lines[1]
    assert lines[2].endswith("~1m20s left]")  # after step 1: 8 steps left, 10 s apart
    assert lines[3].endswith("~1m10s left]")


def test_the_summary_says_the_elapsed_time_and_the_time_left(tmp_path):
    paths = RunPaths(tmp_path)
    for step in range(4):
        append_metrics(paths, {"process": "orchestrator", "step": step, "time": 5.0 * step, "reward": 0.1 * step})
        append_metrics(paths, trainer(step, 5.0 * step + 1, loss=1.0))
    summary = summarize(paths, elapsed_s=125.0, max_steps=6)
    assert summary["time_left_s"] == pytest.approx(10.0)
    assert format_summary(summary).endswith("; 2m05s elapsed, ~10s left")
    assert format_summary(summarize(paths, elapsed_s=125.0, max_steps=4)).endswith("max_steps reached")
    assert format_summary(summarize(RunPaths(tmp_path / "none"), 3.0, 4)) == (
        "no steps finished; 3s elapsed, time left: no estimate before 2 trainer steps")


# ---- rl report ----


def synthetic_run(root, steps: int = 6) -> RunPaths:
    """A run's directory as `rl` leaves it, with every key the report plots and a record half written."""
    paths = RunPaths(root)
    paths.configs.mkdir(parents=True)
    (paths.configs / "rl.toml").write_text(
        'max_steps = 8\n[trainer]\nmax_steps = 8\n[inference]\napi_key = "<hidden>"\n')
    (paths.configs / "orchestrator.toml").write_text(
        'max_steps = 8\n[client]\nadmin_token = "tok-3f9a1c77"\nbase_urls = ["http://me:pw-55e1@127.0.0.1:8000"]\n')
    now = time.time()
    os.utime(paths.configs / "rl.toml", (now - 200, now - 200))  # the launch, before every record
    for step in range(steps):
        at = now - 100 + 10 * step
        append_metrics(paths, {
            "process": "orchestrator", "step": step, "time": at - 5, "reward": 0.1 * step, "tokens_per_s": 900.0,
            "staleness": 1, "off_policy/max": 1, "off_policy/mean": 0.5, "time/wait_for_policy": 0.2,
            "rollouts_in_flight": 64, "engine/kv_cache_usage": 0.4, "concurrency/cap": 96, "engine/preemptions": 0,
            "off_policy/discarded_tokens": 0.01, "completion_len": 40.0, "off_policy/trained_len": 38.0,
            **({"eval/reward": 0.3} if step % 3 == 0 else {})})
        append_metrics(paths, trainer(step, at, loss=1.0 / (step + 1), tokens_per_s=5000.0, ratio_p1=0.9,
                                      ratio_p50=1.0, ratio_p99=1.1, mismatch_corr=0.99, masked_frac=0.02,
                                      masked_seq_frac=0.05, **{"time/wait_for_batch": 1.5}))
        for kind in ("forward_backward", "optim_step"):  # as rl serve-api's service logs each request
            append_metrics(paths, {"process": "service", "step": step, "time": at, "call": kind,
                                   f"call_s/{kind}": 0.2, f"trainer_s/{kind}": 0.15})
    with open(paths.metrics, "a") as f:
        f.write('{"process": "trainer", "step": %d, "lo' % steps)  # the trainer writing its next record
    return paths


def figures(page: str) -> dict[str, bytes]:
    """Each figure's title and its image's bytes."""
    found = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)
    return {title: base64.b64decode(data) for title, data in found}


def test_the_report_is_one_page_with_every_plot_the_summary_and_the_configs_with_secrets_masked(tmp_path):
    paths = synthetic_run(tmp_path / "run")
    out = write_report(paths)
    page = out.read_text()
    assert out == tmp_path / "run" / "report.html"
    plots = figures(page)
    assert sorted(plots) == sorted(PLOTS)
    assert all(png[:4] == b"\x89PNG" for png in plots.values())
    assert "orchestrator eval/reward" in page and "trainer time/wait_for_batch" in page
    assert "orchestrator concurrency/cap" in page and "orchestrator engine/kv_cache_usage" in page
    assert "service call_s/forward_backward" in page and "service trainer_s/optim_step" in page
    assert "Not logged" not in page
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page
    assert "6 of 8" in page and "~20s" in page  # steps 0..5 trained 10 s apart: 2 left
    assert "computed from metrics.jsonl" in page  # no summary.json: the run is going
    assert "configs/rl.toml" in page and "configs/orchestrator.toml" in page
    assert "tok-3f9a1c77" not in page and "pw-55e1" not in page and "&lt;hidden&gt;" in page
    assert (tmp_path / "run" / "metrics.jsonl").read_text().endswith('"lo')  # read only


def test_plots_of_keys_no_record_holds_are_left_out_and_listed(tmp_path):
    paths = RunPaths(tmp_path)
    for step in range(3):
        append_metrics(paths, {"process": "orchestrator", "step": step, "time": 10.0 * step, "reward": 0.5})
        append_metrics(paths, trainer(step, 10.0 * step + 1, loss=0.5))
    page = write_report(paths).read_text()
    assert sorted(figures(page)) == ["Reward", "Trainer loss"]
    listed = re.search(r"Not logged in this run: ([^<]*)</p>", page).group(1)
    for key in ("eval/reward", "tokens_per_s", "off_policy/max", "time/wait_for_policy", "rollouts_in_flight",
                "kv_cache", "preempt"):
        assert key in listed
    assert "Tinker" not in listed  # no process of this run is rl serve-api's service: nothing of it is missing
    assert "not known: no max_steps" in page  # no configs/


def test_a_summary_json_written_after_the_last_record_is_the_summary_shown(tmp_path):
    paths = synthetic_run(tmp_path)
    paths.summary.write_text('{"steps": 6, "reward_gain": 0.25}\n')
    page = write_report(paths).read_text()
    assert "<p>summary.json</p>" in page and "0.25" in page


@pytest.mark.parametrize("layout, missing", [
    ("absent", "is not a directory"),
    ("empty", "neither metrics.jsonl nor configs/"),
    ("configs only", "has recorded no step yet"),
    ("half a record", "holds no complete step record"),
])
def test_a_directory_that_holds_no_run_is_an_error_naming_it(tmp_path, capsys, layout, missing):
    root = tmp_path / "run"
    if layout != "absent":
        root.mkdir()
    if layout == "configs only":
        (root / "configs").mkdir()
    if layout == "half a record":
        (root / "metrics.jsonl").write_text('{"process": "trainer", "st')
    with pytest.raises(NoRun, match=missing):
        write_report(RunPaths(root))
    with pytest.raises(SystemExit) as exit:
        rl_main(["report", str(root)])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("rl report: error: ") and str(root) in err and missing in err
    assert not (root / "report.html").exists()


def test_rl_report_writes_the_page_and_says_where(tmp_path, capsys):
    synthetic_run(tmp_path / "run")
    rl_main(["report", str(tmp_path / "run")])
    assert capsys.readouterr().out == f"rl report: wrote {tmp_path / 'run' / 'report.html'}\n"
    assert len(figures((tmp_path / "run" / "report.html").read_text())) == len(PLOTS)
    with pytest.raises(SystemExit) as exit:
        rl_main(["report"])
    assert exit.value.code == 2 and "usage: rl report <run-dir>" in capsys.readouterr().err


def test_the_launcher_writes_the_report_at_the_end_of_a_run_and_says_when_there_is_none(tmp_path, capsys):
    supervisor = Supervisor(RunPaths(tmp_path / "empty"), tail_lines=5, shutdown_timeout_s=5, max_steps=8)
    (tmp_path / "empty").mkdir()
    supervisor._write_report()
    assert capsys.readouterr().out.startswith(f"rl: no report: {tmp_path / 'empty'} holds no run")
    paths = synthetic_run(tmp_path / "run")
    Supervisor(paths, tail_lines=5, shutdown_timeout_s=5, max_steps=8)._write_report()
    assert capsys.readouterr().out == f"rl: report {tmp_path / 'run' / 'report.html'}\n"


def test_hostile_metrics_lines_are_named_one_line_each_and_the_rest_is_rendered(tmp_path, capsys):
    """Lines that are not objects, nested 200,000 deep, not UTF-8, integers of 400 and 5,000 digits, a time of
    Infinity, a reward of 1.7e308, a step beyond reason, and a summary.json that is a list: each is said, by line;
    the good records are plotted."""
    paths = synthetic_run(tmp_path / "run")
    good = paths.metrics.read_bytes()[: paths.metrics.read_bytes().rfind(b"\n") + 1]
    hostile = [b"[1, 2]", b"[" * 200_000 + b"]" * 200_000, b'{"process": "trainer", "step": 1, "x": "\xff"}',
               b'{"process": "trainer", "step": 2, "loss": ' + b"9" * 400 + b"}",
               b'{"process": "trainer", "step": 2, "loss": ' + b"9" * 5000 + b"}",
               b'{"process": "orchestrator", "step": 3, "time": Infinity, "reward": 1.7e308}',
               b'{"process": "trainer", "step": 1' + b"0" * 30 + b"}"]
    paths.metrics.write_bytes(b"\n".join(hostile[:3]) + b"\n" + good + b"\n".join(hostile[3:]) + b"\n")
    paths.summary.write_text("[1, 2, 3]")
    rl_main(["report", str(paths.root)])
    err = capsys.readouterr().err.splitlines()
    first_after = good.count(b"\n") + 4
    assert err == ["rl report: metrics.jsonl line 1: a JSON list, not an object",
                   "rl report: metrics.jsonl line 2: nested too deep",
                   "rl report: metrics.jsonl line 3: not UTF-8",
                   f"rl report: metrics.jsonl line {first_after}: loss not a plottable number, left out",
                   err[4],  # Python's own words on the 5,000 digits
                   f"rl report: metrics.jsonl line {first_after + 2}: time, reward not a plottable number, left out",
                   f"rl report: metrics.jsonl line {first_after + 3}: step 10000000000000000000 out of range"]
    assert err[4].startswith(f"rl report: metrics.jsonl line {first_after + 1}: not JSON (")
    page = report_path(paths).read_text()
    assert sorted(figures(page)) == sorted(PLOTS) and "Left out of the plots: metrics.jsonl line 1" in page
    assert "computed from metrics.jsonl" in page  # the list in summary.json is not a summary
