"""The `eval` command's bad input: each case exits 2 before any server starts, naming the problem, and writes
nothing over earlier results."""

import json

import pytest

from rl.eval import main as eval_main
from rl.protocol import mark_stable
from rl.tiny_model import build_tiny_model


@pytest.fixture
def refuse_to_evaluate(monkeypatch):
    def evaluated(*args, **kwargs):
        raise AssertionError("eval started despite bad input")

    monkeypatch.setattr(eval_main, "evaluate", evaluated)


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        eval_main.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    return err


def test_bad_eval_input_is_refused_by_name(tmp_path, capsys, refuse_to_evaluate):
    model = tmp_path / "weights" / "step_3"
    build_tiny_model(model)
    mark_stable(model, step=3)
    out = tmp_path / "eval"
    base = ["--model.name", str(model), "--output-dir", str(out)]
    assert "rollouts_per_example = 4 with greedy sampling" in fails(base + ["--rollouts-per-example", "4"], capsys)
    assert "'no-such-env' is not installed" in fails(base + ["--env", json.dumps([{"id": "no-such-env"}])], capsys)
    assert "contradicts model.name" in fails(base + ["--inference.model.name", "other"], capsys)
    assert "does not exist" in fails(["--model.name", str(tmp_path / "nowhere"), "--output-dir", str(out)], capsys)
    assert not out.exists()

    out.mkdir()
    (out / "results.jsonl").write_text("earlier results\n")
    assert "already holds results.jsonl" in fails(base, capsys)
    assert (out / "results.jsonl").read_text() == "earlier results\n"

    with open(model / "model.safetensors", "r+b") as f:  # a weight file changed after it was published
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    changed = fails(base[:2] + ["--output-dir", str(tmp_path / "e2")], capsys)
    assert "model.safetensors fails its CRC-32 check" in changed
