# Images of rl, one per stack; scripts/install.sh installs either into /app/.venv.
#   CPU: put the torch 2.13.0+cpu wheel in ./wheels, then  docker build -t rl .
#   GPU: docker build --build-arg RL_STACK=gpu -t rl-gpu .   (no wheel folder; run with --gpus all,
#        NVIDIA driver >= 580 for the CUDA 13 builds of torch 2.13 and vLLM 0.32)
ARG RL_STACK=cpu
ARG UV_VERSION=0.13.9

FROM python:3.11-slim AS uv-tool
ARG UV_VERSION
RUN pip install --no-cache-dir "uv==${UV_VERSION}"

# CPU stack: Python 3.11 on Debian; torch's CPU build comes from the wheel folder copied in with the context.
FROM python:3.11-slim AS base-cpu
ENV RL_STACK=cpu UV_FIND_LINKS=/app/wheels

# GPU stack: torch 2.13 and vLLM 0.32 bring their CUDA 13 libraries as nvidia-* wheels; the image adds the
# CUDA 13 runtime, the container toolkit's settings and its driver check. uv installs Python 3.11 itself.
FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS base-gpu
ENV RL_STACK=gpu UV_PYTHON=3.11 UV_PYTHON_INSTALL_DIR=/opt/uv-python

FROM base-${RL_STACK}
ARG DEBIAN_FRONTEND=noninteractive
# gcc: Triton and torch.compile build small C modules at run time
RUN apt-get update \
    && apt-get install -y --no-install-recommends tmux git gcc g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=uv-tool /usr/local/bin/uv /usr/local/bin/uv
WORKDIR /app
COPY . .
ENV UV_LINK_MODE=copy
# install.sh compiles the bytecode (--compile-bytecode)
RUN --mount=type=cache,target=/root/.cache/uv \
    bash scripts/install.sh && .venv/bin/tiny-model --out models/tiny
# The venv's own `rl`: nothing is resolved or installed when a container starts.
ENV PATH=/app/.venv/bin:$PATH
ENTRYPOINT ["rl"]
