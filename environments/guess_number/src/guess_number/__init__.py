"""guess-number: an offline multi-turn verifiers environment.

The `Env` drives the exchange: the model's reply to the prompt is the first guess; the environment
answers higher/lower as a user turn and takes the next guess, until `correct` or `max_guesses`
replies. verifiers keeps the whole exchange in one trace, the environment's turns unsampled.
"""

import verifiers.v1 as vf

from in_process_chat import InProcessChatConfig, InProcessChatHarness, SharedChatSession
from guess_number.taskset import (
    GuessNumberConfig,
    GuessNumberData,
    GuessNumberTask,
    GuessNumberTaskset,
    feedback,
    parse_guess,
)


class GuessNumberEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())


class GuessNumberEnv(SharedChatSession, vf.Env[GuessNumberEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as game:
            segment = await game.turn()  # a prompted task speaks first: the first guess
            for _ in range(data.max_guesses):
                if segment.terminated:
                    return
                reply = feedback(parse_guess(segment.last_reply), data.target)
                if reply == "correct":
                    return
                segment = await game.turn(reply)


__all__ = [
    "InProcessChatConfig",
    "InProcessChatHarness",
    "GuessNumberConfig",
    "GuessNumberData",
    "GuessNumberEnv",
    "GuessNumberEnvConfig",
    "GuessNumberTask",
    "GuessNumberTaskset",
    "feedback",
    "parse_guess",
]
