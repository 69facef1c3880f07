"""The teacher of on-policy distillation (rl/orchestrator/teacher.py) against a fake vLLM server, and `rl` refusing
a teacher that tokenizes otherwise than the student before anything starts."""

import asyncio
import json
import math
import re
import shutil

import httpx
import pytest

from rl.config import ConfigError
from rl.orchestrator.config import TeacherConfig
from rl.orchestrator.teacher import PROBES, Teacher, TeacherError
from rl.samples import Sample


def fake_logprob(token: int) -> float:
    return -3.0 - 0.01 * token


def fake_vllm(requests: list, drop_token: int | None = None, tokenize=lambda text: [ord(c) for c in text]):
    """vLLM's /v1/completions as the teacher uses it: prompt logprobs of token-id prompts, token ids of text."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "teacher"}]})
        body = json.loads(request.content)
        requests.append(body)
        if isinstance(body["prompt"], str):
            return httpx.Response(200, json={"choices": [{"index": 0, "prompt_token_ids": tokenize(body["prompt"])}]})
        k = body["prompt_logprobs"]
        choices = [{"index": i, "prompt_logprobs": [None] + [
            {} if t == drop_token else ranked(t, k) for t in ids[1:]]}
            for i, ids in enumerate(body["prompt"])]
        return httpx.Response(200, json={"choices": choices[::-1]})  # in any order: matched by index

    return httpx.MockTransport(handle)


def ranked(token: int, k: int) -> dict:
    """A position's prompt logprobs as vLLM lists them, in no particular order (here the likeliest last): the token
    itself, ranked 4th, and the top k, tokens 100 + token + i for the other ranks i + 1 (the probabilities sum to
    less than 1)."""
    others = {str(100 + token + i): {"logprob": -1.0 - 0.1 * (i + 1) if i < 3 else -4.0 - 0.1 * i, "rank": i + 1}
              for i in range(k) if i != 3}
    return dict(reversed([*others.items(), (str(token), {"logprob": fake_logprob(token), "rank": 4})]))


def teacher(transport, batch_tokens: int = 10) -> Teacher:
    t = Teacher(TeacherConfig(base_url="http://teacher:8001", batch_tokens=batch_tokens))
    t.http = httpx.AsyncClient(base_url="http://teacher:8001", transport=transport)
    t.model = "teacher"
    return t


def sample(ids: list[int], prompt: int) -> Sample:
    n = len(ids)
    return Sample(ids, [0] * prompt + [1] * (n - prompt), [0.0] * prompt + [-1.0] * (n - prompt), 0.5, 1.0, 0)


def test_every_trained_token_gets_the_teachers_logprob_in_requests_of_at_most_batch_tokens():
    requests = []
    samples = [sample([1, 2, 3, 4, 5, 6], 3), sample([7, 8, 9], 1), sample([10, 11, 12, 13], 2)]
    scored = asyncio.run(teacher(fake_vllm(requests)).score(samples))
    assert sorted(len(r["prompt"]) for r in requests) == [1, 2]  # 6 tokens, then 3 + 4 (<= 10), sent at once
    assert all(r["prompt_logprobs"] == 0 and r["max_tokens"] == 1 for r in requests)
    assert [s.input_ids for s in scored] == [s.input_ids for s in samples]
    for s in scored:
        assert s.teacher_logprobs == [fake_logprob(t) if m else 0.0 for t, m in zip(s.input_ids, s.loss_mask)]


def test_with_top_k_every_trained_token_also_gets_the_teachers_k_likeliest_tokens_likeliest_first():
    requests = []
    t = teacher(fake_vllm(requests))
    t.config = t.config.model_copy(update={"top_k": 5})
    samples = [sample([1, 2, 3, 4, 5, 6], 3), sample([7, 8, 9], 1)]
    scored = asyncio.run(t.score(samples))
    assert all(r["prompt_logprobs"] == 5 for r in requests)
    for s in scored:
        assert s.teacher_logprobs == [fake_logprob(t) if m else 0.0 for t, m in zip(s.input_ids, s.loss_mask)]
        for token, trained, ids, logprobs in zip(s.input_ids, s.loss_mask, s.teacher_top_ids, s.teacher_top_logprobs):
            if not trained:
                assert ids == [0] * 5 and logprobs == [0.0] * 5
                continue
            assert ids == [100 + token, 101 + token, 102 + token, token, 104 + token]
            assert logprobs == pytest.approx([-1.1, -1.2, -1.3, fake_logprob(token), -4.4])


def test_a_top_k_reply_with_too_few_entries_or_tokens_past_the_vocabulary_is_an_error():
    from rl.orchestrator.teacher import top_tokens

    s = sample([1, 2, 3], 1)
    full = [None, ranked(2, 4), ranked(3, 4)]
    assert len(top_tokens(s, full, 4)[0][1]) == 4
    with pytest.raises(TeacherError, match="hold 4 valid entries where top_k = 6 asks for 6"):
        top_tokens(s, full, 6)
    with pytest.raises(TeacherError, match="outside the student's vocabulary of 104"):
        top_tokens(s, full, 4, vocab_size=104)
    nan = [None, {"2": {"logprob": float("nan")}, "5": {"logprob": -1.0}}, ranked(3, 4)]
    with pytest.raises(TeacherError, match="valid entries"):
        top_tokens(s, nan, 2)


def test_a_reply_without_a_tokens_logprob_is_an_error_naming_it():
    with pytest.raises(TeacherError, match="lack token 5"):
        asyncio.run(teacher(fake_vllm([], drop_token=5)).score([sample([1, 2, 5], 1)]))


def test_a_token_the_teacher_rules_out_counts_as_floored_and_nan_is_refused():
    from rl.orchestrator.teacher import MIN_LOGPROB, token_logprobs

    s = sample([1, 2, 3], 1)
    ranked = [None, {"2": {"logprob": float("-inf")}}, {"3": {"logprob": -0.5}}]
    assert token_logprobs(s, ranked) == [0.0, MIN_LOGPROB, -0.5]
    with pytest.raises(TeacherError, match="logprob of token 3 is nan"):
        token_logprobs(s, [None, {"2": {"logprob": -1.0}}, {"3": {"logprob": float("nan")}}])


def test_a_teacher_that_tokenizes_otherwise_is_refused_at_start():
    class Student:
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    asyncio.run(teacher(fake_vllm([])).start(Student(), "student", timeout_s=5))  # the same tokenizer: accepted
    other = fake_vllm([], tokenize=lambda text: [ord(c) + 1 for c in text])
    with pytest.raises(TeacherError, match=f"tokenizes {re.escape(repr(PROBES[0]))} as .* must share the student's"):
        asyncio.run(teacher(other).start(Student(), "student", timeout_s=5))


def test_rl_refuses_a_teacher_with_another_tokenizer_before_starting_anything(tiny_model, tmp_path, capsys):
    from rl.launcher.main import main
    from tests.integration.launched import rl_command

    other = tmp_path / "teacher"
    shutil.copytree(tiny_model, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = tmp_path / "run"
    argv = rl_command(tiny_model, out, 3, "--teacher.model", str(other), "--trainer.loss.distill", "1")[3:]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"the teacher {str(other)!r} tokenizes" in error and "must share the student's tokenizer" in error
    assert not (out / "logs").exists()  # nothing started


def test_identical_tokenizer_files_need_no_loading_and_any_difference_does(tiny_model, tmp_path):
    from rl.checks import same_tokenizer_files

    other = tmp_path / "teacher"
    shutil.copytree(tiny_model, other)
    (other / "model.safetensors").write_bytes(b"other weights")  # not a tokenizer file
    assert same_tokenizer_files(str(tiny_model), str(other))
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 7}', 1))
    assert not same_tokenizer_files(str(tiny_model), str(other))
    config.unlink()  # one side without a file the other has
    assert not same_tokenizer_files(str(tiny_model), str(other))
    assert not same_tokenizer_files(str(tiny_model), "Qwen/Qwen3-0.6B")  # a hub id: loaded and compared


def test_distillation_and_a_teacher_come_together(tiny_model, tmp_path, capsys):
    from rl.launcher.main import main
    from tests.integration.launched import rl_command

    for extra, message in (
        (["--trainer.loss.distill", "1"], "trainer.loss.distill = 1.0 needs a teacher"),
        (["--teacher.model", str(tiny_model)], "trainer.loss.distill_top_k = 0 would ignore it"),
        (["--teacher.model", str(tiny_model), "--trainer.loss.distill-top-k", "1"], "needs the teacher's top-k"),
        (["--teacher.model", str(tiny_model), "--teacher.top-k", "4", "--trainer.loss.distill", "1"],
         "the teacher ships its top 4 tokens but trainer.loss.distill_top_k = 0 would ignore them"),
        (["--trainer.loss.distill-top-k", "1"], "trainer.loss.distill_top_k = 1.0 needs a teacher"),
    ):
        with pytest.raises(SystemExit):
            main(rl_command(tiny_model, tmp_path / "run", 3, *extra)[3:])
        assert message in capsys.readouterr().err


def test_on_a_gpu_host_the_teacher_takes_the_last_gpus_and_the_others_split_as_without_it(tmp_path, monkeypatch):
    from rl.launcher import main as launcher
    from rl.launcher.main import child_specs, load
    from rl.protocol import RunPaths
    from tests.unit.test_deploy import FILES

    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 8)
    argv = FILES + ["--output-dir", str(tmp_path / "run"), "--model.name", "m/m", "--inference.dtype", "bfloat16",
                    "--teacher.model", "t/t", "--teacher.gpus", "2", "--trainer-gpus", "4", "--trainer.loss.distill",
                    "1"]
    config, host = load(argv)
    assert host.devices.teacher_gpus == (6, 7)
    assert host.devices.inference_gpus == [[0], [1]] and host.devices.trainer_gpus == [2, 3, 4, 5]
    assert config.teacher_server.tensor_parallel_size == 2 and config.teacher_server.model.name == "t/t"
    assert config.orchestrator.teacher.base_url == f"http://127.0.0.1:{config.inference.port + 2}"
    specs = {spec.name: spec for spec in child_specs(config, host, RunPaths(tmp_path / "run"))}
    assert specs["teacher"].gpus == ["6", "7"] and specs["teacher"].cmd[-1].endswith("teacher.toml")
    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 2)
    with pytest.raises(ConfigError, match="teacher.gpus = 1 of 2 visible GPUs leaves 1 for the trainer and inference"):
        load(argv[:-6] + ["--trainer.loss.distill", "1"])  # the teacher's default: 1 GPU


def replying(position: str | dict, size: int = 3):
    """A teacher whose reply ranks, at the last position of a `size`-token sample, `position` (a dict, or raw JSON
    text for what a dict cannot hold), and at the others the fake's ranking with k = 2."""
    def handle(request: httpx.Request) -> httpx.Response:
        ids = json.loads(request.content)["prompt"][0]
        marker = {"marker": 1}
        rows = [None, *(ranked(t, 2) for t in ids[1:-1]), marker if isinstance(position, str) else position]
        text = json.dumps({"choices": [{"index": 0, "prompt_logprobs": rows}]})
        if isinstance(position, str):
            text = text.replace(json.dumps(marker), position)
        return httpx.Response(200, content=text.encode(), headers={"content-type": "application/json"})

    t = teacher(httpx.MockTransport(handle))
    t.config = t.config.model_copy(update={"top_k": 2})
    t.vocab_size = 1000
    return t, [sample(list(range(1, size + 1)), 1)]


@pytest.mark.parametrize("key", ["03", "0_3", "+3", " 3", "3.0", "\u0663", "03 "])  # \u0663: Arabic-Indic three
def test_a_top_k_id_not_in_canonical_decimal_form_is_refused(key):
    t, samples = replying({"3": {"logprob": -1.0}, key: {"logprob": -2.0}})
    with pytest.raises(TeacherError, match=f"token id {re.escape(repr(key))}: ids are written in canonical decimal"):
        asyncio.run(t.score(samples))


def test_a_top_k_id_named_twice_at_one_position_is_refused():
    t, samples = replying('{"3": {"logprob": -1.0}, "7": {"logprob": -2.0}, "7": {"logprob": -3.0}}')
    with pytest.raises(TeacherError, match="names key '7' twice"):
        asyncio.run(t.score(samples))


def test_top_k_probabilities_summing_past_one_are_refused_and_up_to_one_accepted():
    t, samples = replying({"3": {"logprob": -0.1}, "7": {"logprob": -0.2}, "8": {"logprob": -0.3}})
    with pytest.raises(TeacherError, match=r"probabilities at one position sum to 2\.4\d* > 1 \(\+ 0\.001"):
        asyncio.run(t.score(samples))
    half = math.log(0.5)
    t, samples = replying({"3": {"logprob": half}, "7": {"logprob": half + 1e-4}})  # 1.0001: float slack
    assert asyncio.run(t.score(samples))[0].teacher_top_ids[2] == [7, 3]


def test_a_position_ranking_more_than_top_k_tokens_besides_its_own_is_refused():
    t, samples = replying({"3": {"logprob": -9.0}, "7": {"logprob": -2.0}, "8": {"logprob": -3.0},
                           "9": {"logprob": -4.0}})
    with pytest.raises(TeacherError, match="ranks 3 tokens besides token 3 where top_k = 2"):
        asyncio.run(t.score(samples))
    t, samples = replying({"3": {"logprob": -9.0}, "7": {"logprob": -2.0}, "8": {"logprob": -3.0}})
    assert asyncio.run(t.score(samples))[0].teacher_top_ids[2] == [7, 8]  # the top 2 and the token itself


def test_a_reply_past_its_size_bound_is_refused_while_it_streams():
    from rl.orchestrator.teacher import reply_bound

    sent = []

    async def endless():
        yield b'{"choices": [{"index": 0, "prompt_logprobs": [null, {"3": {"logprob": -1.0, "pad": "'
        while True:
            sent.append(1 << 16)
            yield b"x" * (1 << 16)

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    t = teacher(httpx.MockTransport(handle))
    bound = reply_bound(3, 0)
    with pytest.raises(TeacherError, match=f"reply to /v1/completions passed {bound} bytes, its bound for 3 tokens"):
        asyncio.run(t.score([sample([1, 2, 3], 1)]))
    assert sum(sent) <= bound + (1 << 17)  # read as it came, not to its end

    def announced(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless(), headers={"content-length": str(bound + 1)})

    sent.clear()
    with pytest.raises(TeacherError, match=f"announces {bound + 1} bytes"):
        asyncio.run(teacher(httpx.MockTransport(announced)).score([sample([1, 2, 3], 1)]))
    assert sum(sent) <= 1 << 17
