# Images of rl, one per stack; scripts/install.sh installs either into /app/.venv. Docker (BuildKit) and
# podman/buildah 4.x build it alike; scripts/image-check.sh builds the CPU image and runs rl in it.
#   CPU: put the torch 2.13.0+cpu wheel in ./wheels, then  docker build -t rl .
#   GPU: docker build --build-arg RL_STACK=gpu --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 -t rl-gpu .
#        (no wheel folder; run with --gpus all, NVIDIA driver >= 580 for the CUDA 13 builds of torch 2.13 and vLLM 0.32)
# Behind a registry mirror, name its images: --build-arg BASE_IMAGE=<mirror>/python:3.11-slim --build-arg UV_IMAGE=...
ARG RL_STACK=cpu
ARG BASE_IMAGE=python:3.11-slim
ARG UV_IMAGE=python:3.11-slim
ARG UV_VERSION=0.13.9

FROM ${UV_IMAGE} AS uv-tool
ARG UV_VERSION
RUN pip install --no-cache-dir "uv==${UV_VERSION}"

# The stack's base is an argument, not a stage chosen by one (`FROM base-${RL_STACK}`), which buildah 1.28 and
# podman 4.3 (Debian 12, Ubuntu 22.04) do not resolve. CPU: Debian's Python 3.11. GPU: the CUDA 13 runtime, the
# container toolkit's settings and its driver check; uv installs Python 3.11 there (UV_PYTHON).
FROM ${BASE_IMAGE}
ARG RL_STACK
ARG DEBIAN_FRONTEND=noninteractive
ENV RL_STACK=${RL_STACK} UV_PYTHON=3.11 UV_PYTHON_INSTALL_DIR=/opt/uv-python
# gcc: Triton and torch.compile build small C modules at run time; libnuma1: vLLM's CPU kernels (vllm._C) load it
RUN apt-get update \
    && apt-get install -y --no-install-recommends tmux git gcc g++ ca-certificates libnuma1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=uv-tool /usr/local/bin/uv /usr/local/bin/uv
WORKDIR /app
COPY . .
ENV UV_LINK_MODE=copy
# install.sh compiles the bytecode (--compile-bytecode); the CPU stack's torch comes from ./wheels; no test tools.
# What takes the space: the venv's torch, triton and vLLM, then their dependencies (llvmlite, opencv, transformers),
# gcc and g++, Debian's Python (sizes in benchmarks/RESULTS.md).
RUN --mount=type=cache,target=/root/.cache/uv \
    if [ "$RL_STACK" = cpu ]; then export UV_FIND_LINKS=/app/wheels; fi \
    && RL_NO_DEV=1 RL_NO_MODIFY_PATH=1 bash scripts/install.sh && .venv/bin/tiny-model --out models/tiny \
    && chmod -R a+rX models  # transformers writes weights 0600 (a temp file renamed): the user below must read them
# The venv's own `rl`: nothing is resolved or installed when a container starts.
ENV PATH=/app/.venv/bin:$PATH
# Not root: a process that runs environments' code and holds keys gets no more than it needs. /app stays root's
# (read only for the user); runs write to /app/outputs (mount a volume there) or anywhere the user may, vLLM's and
# Triton's caches go to the user's home. UID 1000 matches most hosts' first user, so mounted folders stay readable.
RUN useradd --create-home --uid 1000 --user-group rl && install -d -o rl -g rl /app/outputs
USER rl
ENTRYPOINT ["rl"]
