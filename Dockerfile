# syntax=docker/dockerfile:1
# loraloom images, one Dockerfile, two targets (see docker-compose.yml):
#   docker build --target api    -t loraloom-api .      the control plane: the core package, no torch
#   docker build --target worker -t loraloom-worker .   the worker pool: CPU torch by default
#   docker build --target worker --build-arg TORCH_VARIANT=cu128 -t loraloom-worker:gpu .
# TORCH_VARIANT names one of PyTorch's wheel indexes (cpu, cu126, cu128, ...): pick one that
# publishes the pinned TORCH_VERSION. Nothing secret is baked in: keys, tokens and database
# passwords come from the environment at run time (.env.example).

ARG PYTHON_IMAGE=python:3.11-slim

# ---- base: what both images share -------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The services run as this user (by number in USER, so that runAsNonRoot-style checks can see
# it is not root). /data (artifacts, checkpoints) and /models (model cache) exist
# and belong to it, so named volumes mounted there start out writable by it.
RUN useradd --create-home --uid 10001 --user-group loraloom \
    && mkdir -p /data /models \
    && chown loraloom:loraloom /data /models

# Every path the services write to is absolute, never relative to the working directory.
ENV LORALOOM_DATA_DIR=/data
WORKDIR /home/loraloom

# ---- build: the wheel (non-editable; the migrations ship inside the app package) ---------
FROM base AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY app ./app
COPY trainer_core ./trainer_core
COPY orchestrator ./orchestrator
COPY loraloom ./loraloom
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- api: the control plane (FastAPI, SQLAlchemy, Alembic, psycopg); never imports torch --
FROM base AS api
COPY --from=build /wheels /wheels
RUN pip install /wheels/loraloom-*.whl && rm -rf /wheels
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
# Migrations first, then the server (docker-compose.yml runs the same command).
CMD ["sh", "-c", "loraloom db upgrade && exec loraloom serve --host 0.0.0.0 --port 8000"]

# ---- worker: the pool (torch, transformers, peft) ----------------------------------------
FROM base AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# torch first, pinned, from PyTorch's own index for the chosen variant (the CPU build is a
# fraction of the CUDA one); the package install below finds it satisfied and keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /wheels /wheels
# DL3013 (pin versions): this is the project's own wheel, built above; its dependencies are the
# ranges of pyproject.toml, as for the api image.
# hadolint ignore=DL3013
RUN set -- /wheels/loraloom-*.whl \
    && pip install "$1[worker]" \
    && rm -rf /wheels
# The model cache on its own volume: the built-in model is built once, hub models download once
# (transformers' cache under HF_HOME).
ENV LORALOOM_MODEL_CACHE=/models \
    HF_HOME=/models/huggingface
USER 10001:10001
CMD ["loraloom", "worker", "--url", "http://api:8000"]
