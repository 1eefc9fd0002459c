# One image for the loraloom API service (control plane) and the worker pool (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv/loraloom

# torch first, pinned, so the package install below finds it satisfied. The default index
# serves the CUDA build (gigabytes); for a small CPU-only image pass PyTorch's CPU wheel
# index: docker build --build-arg TORCH_INDEX_URL=<cpu wheel index> .
ARG TORCH_INDEX_URL=""
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0

COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY app ./app
COPY trainer_core ./trainer_core
COPY orchestrator ./orchestrator
COPY loraloom ./loraloom
# The migrations ship inside the app package, so a plain (non-editable) install can migrate.
RUN pip install .

RUN useradd --create-home --uid 10001 loraloom \
    && mkdir -p /data \
    && chown loraloom:loraloom /data
USER loraloom

ENV LORALOOM_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 8000

CMD ["sh", "-c", "loraloom db upgrade && exec loraloom serve --host 0.0.0.0 --port 8000"]
