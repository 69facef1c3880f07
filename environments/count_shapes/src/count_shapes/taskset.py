"""Count the shapes on a picture drawn from a seed; the reward is 1 for the exact count, partial credit nearby.

Task `i` depends only on (`seed`, `i`): its picture is drawn by Pillow from a generator seeded by both, so every
process that loads the taskset with the same arguments sends the same images.
"""

from __future__ import annotations

import base64
import io
import random
import re

import verifiers.v1 as vf
from in_process_chat import DataIdKey
from PIL import Image, ImageDraw
from pydantic import Field

COLOURS = ["black", "red", "blue", "green"]
KINDS = ["circle", "square", "triangle"]


class CountShapesConfig(vf.TasksetConfig):
    """Taskset arguments (`--env.taskset.*`)."""

    num_examples: int = Field(1000, ge=1, description="Number of tasks.")
    max_shapes: int = Field(4, ge=1, le=9, description="Most shapes on one picture (at least 1).")
    size: int = Field(64, ge=32, le=512, description="Width and height of the picture in pixels.")
    seed: int = Field(0, description="Seed the pictures are drawn from.")
    question: str = Field("How many shapes?", min_length=1, description="The text after the image.")


class CountShapesData(vf.TaskData):
    count: int


class CountShapesTask(DataIdKey, vf.Task[CountShapesData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def count_reward(self, task: CountShapesData, trace: vf.Trace) -> float:
        guess = first_number(trace.last_reply)
        return 0.0 if guess is None else 1 / (1 + abs(guess - task.count))

    @vf.metric
    async def exact_count(self, task: CountShapesData, trace: vf.Trace) -> float:
        return float(first_number(trace.last_reply) == task.count)


class CountShapesTaskset(vf.Taskset[CountShapesTask, CountShapesConfig]):
    def load(self):
        config = self.config
        for i in range(config.num_examples):
            count, url = draw_picture(config, i)
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": config.question}]
            yield CountShapesTask(
                CountShapesData(id=f"s{config.seed}-{i}", prompt=[{"role": "user", "content": content}], count=count),
                config.task,
            )


def draw_picture(config: CountShapesConfig, index: int) -> tuple[int, str]:
    """Task `index`'s count and picture (a PNG data URL): shapes on a grid of cells, one per cell, so none overlap."""
    rng = random.Random(f"count-shapes:{config.seed}:{index}")
    count = rng.randint(1, config.max_shapes)
    cells = 3 if config.max_shapes <= 9 else 4
    cell = config.size // cells
    image = Image.new("RGB", (config.size, config.size), "white")
    draw = ImageDraw.Draw(image)
    for place in rng.sample(range(cells * cells), count):
        x, y = (place % cells) * cell, (place // cells) * cell
        box = [x + cell // 5, y + cell // 5, x + cell - cell // 5, y + cell - cell // 5]
        kind, colour = rng.choice(KINDS), rng.choice(COLOURS)
        if kind == "circle":
            draw.ellipse(box, fill=colour)
        elif kind == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=colour)
    png = io.BytesIO()
    image.save(png, "PNG")
    return count, "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def first_number(text: str) -> int | None:
    match = re.search(r"\d+", text or "")
    return int(match.group()) if match else None
