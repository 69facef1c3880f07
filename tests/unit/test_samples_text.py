"""Every rollout seen (issue 90, part 1): a few rollouts per environment and step as text, in samples/step_k.jsonl
and in `rl report`'s samples, searchable, escaped, cut visibly, and a bad line named without losing the rest."""

import json
import random

from rl.envs.rollouts import RolloutResult, TokenSegment
from rl.launcher.run_report import write_report
from rl.orchestrator.samples_text import cut, picked, step_samples, table_rows, write_samples
from tests.unit.test_run_report import synthetic_run


def decode(ids: list[int]) -> str:
    return "".join(chr(96 + i) for i in ids)


def rollout(reward: float, task: str = "t", completion=(1, 2, 9, 3), mask=(1, 1, 0, 1)) -> RolloutResult:
    segment = TokenSegment([20, 21], list(completion), list(mask), [-0.5] * len(mask),
                           [3 if m else None for m in mask])
    return RolloutResult(0, task, [segment], reward, {"lcs": reward}, {"exact": 0.0}, False, 2)


def test_each_environment_gives_its_best_worst_and_a_random_rollout_each_once():
    results = [rollout(0.2, "a"), rollout(0.9, "b"), rollout(0.1, "c")]
    chosen = picked(results, ["best", "worst", "random"], random.Random(0))
    assert [(pick, r.task_id) for pick, r in chosen][:2] == [("best", "b"), ("worst", "c")]
    assert len({id(r) for _, r in chosen}) == len(chosen)  # a random pick of the best is not written twice
    assert picked([], ["best"], random.Random(0)) == []
    assert [p for p, _ in picked([rollout(1.0)], ["best", "worst", "random"], random.Random(0))] == ["best"]


def test_a_record_holds_the_prompt_and_each_turn_with_who_wrote_it():
    (record,) = step_samples(4, {"rev": [rollout(0.5, "s0-3")]}, ["best"], 100, 0, decode)
    assert record["prompt"] == "tu" and record["step"] == 4 and record["pick"] == "best"
    assert record["turns"] == [{"role": "model", "text": "ab"}, {"role": "env", "text": "i"},
                               {"role": "model", "text": "c"}]
    assert record["rewards"] == {"lcs": 0.5} and record["policy_versions"] == [3, 3]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (2, 3)
    assert table_rows([record])[0][-1] == "[model] ab\n[env] i\n[model] c"
    again = step_samples(4, {"rev": [rollout(0.5, str(i)) for i in range(9)]}, ["random"], 100, 0, decode)
    assert again == step_samples(4, {"rev": [rollout(0.5, str(i)) for i in range(9)]}, ["random"], 100, 0, decode)


def test_a_long_text_keeps_its_start_and_end_and_says_how_much_was_cut():
    assert cut("x" * 10, 10) == "x" * 10
    shown = cut("a" * 60 + "b" * 60, 100)
    assert shown.startswith("a" * 50) and shown.endswith("b" * 50) and "[... 20 characters cut ...]" in shown


def test_the_report_shows_the_samples_escaped_and_names_a_bad_line(tmp_path):
    paths = synthetic_run(tmp_path / "run")
    records = step_samples(2, {"rev": [rollout(0.7, "<script>alert(1)</script>")]}, ["best"], 100, 0, decode)
    write_samples(paths, 2, records)
    with open(paths.samples(2), "a") as f:
        f.write('["not", "a record"]\n' + json.dumps(records[0] | {"pick": "again"}) + "\n")
    page = write_report(paths).read_text()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert 'id="sample-search"' in page and page.count("<details><summary>2 · rev · ") == 2
    assert "samples/step_2.jsonl line 2: not a sample record" in page
    assert "[model] ab" in page and "reward 0.7" in page


def test_a_run_without_samples_says_so(tmp_path):
    page = write_report(synthetic_run(tmp_path / "run")).read_text()
    assert "no samples/ here" in page
