"""reverse-text for verifiers 0.1 (the API tinker-cookbook's `verifiers_rl` recipe speaks): the same tasks as rl's
`environments/reverse_text` (each string drawn from (seed, index) alone) and the same reward, the LCS ratio of the
reply to the reversed string. benchmarks/tinker_cookbook.py puts this module first on the recipe's path."""

import random
import string

import verifiers as vf
from datasets import Dataset


def draw_text(seed: int, index: int, min_len: int, max_len: int) -> str:
    rng = random.Random(f"reverse-text:{seed}:{index}")  # rl's taskset draws the same way
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))


def lcs_ratio(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return 2 * previous[-1] / (len(a) + len(b))


def load_environment(num_examples: int = 1000, seed: int = 0, min_len: int = 3, max_len: int = 8) -> vf.Environment:
    texts = [draw_text(seed, i, min_len, max_len) for i in range(num_examples)]
    dataset = Dataset.from_list([{"question": text, "answer": text[::-1]} for text in texts])
    parser = vf.Parser()

    def reversed_right(completion, answer, **kwargs) -> float:
        return lcs_ratio(parser.parse_answer(completion) or "", answer)

    return vf.SingleTurnEnv(dataset=dataset, parser=parser, rubric=vf.Rubric(funcs=[reversed_right], weights=[1.0]))
