"""Environments: the verifiers environments a run trains and evaluates on, and where their episodes run.

Shared by the orchestrator, `eval`, the env server (`env-server`) and the launcher; it imports none of them.

- `config.py`: an `[[env]]` table and an env server's config; `loading.py`: an environment loaded as a table says;
- `runner.py`: where its episodes run (`EpisodeRunner`: in this process, or `client.py`'s `ServedEpisodes`);
- `server.py`: the env server and its entry point; `worker.py`: what a process that runs episodes sets up first;
- `groups.py`: a group's episodes as one request, both ends; `seal.py`: an env server sealed with the run's secret;
- `placement.py`: the env servers `rl` starts beside the orchestrator, each at a socket of its own;
- `rollouts.py`: a group of rollouts run and flattened into token-level results; `slots.py`: the bound on rollouts
  in flight; `engine_client.py` and `chat_replies.py`: the HTTP clients episodes sample through.
"""
