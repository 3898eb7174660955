# syntax=docker/dockerfile:1
# One image for both containers of the pod (helm/loraplex): the inference service runs
# `loraplex-inference`, the adapter-cache sidecar runs `loraplex-cache`.
#
# Build args:
#   TORCH_INDEX_URL  wheel index for torch. CPU (default): https://download.pytorch.org/whl/cpu
#                    CUDA: https://download.pytorch.org/whl/cu128 (the CUDA runtime ships inside the
#                    wheels; the node only needs the NVIDIA driver and container toolkit).
#   TORCH_VERSION    torch version, e.g. 2.13.0.
#   PYTHON_VERSION   base Python (3.11+).
#   CPU_KERNELS      1 (default): the runtime image gets a C compiler, with which the inference
#                    service builds its CPU kernels at first start, into $LORAPLEX_KERNEL_CACHE
#                    (the chart points it at an emptyDir only the inference container mounts, since
#                    the process dlopen()s what is there; unset: $HOME/.cache/loraplex/kernels).
#                    0: no compiler (e.g. for CUDA images); the CPU ops then fall back to torch.
# Examples:
#   docker build -t loraplex:cpu .
#   docker build -t loraplex:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loraplex/bin:$PATH
RUN python -m venv /opt/loraplex
# torch first, from the chosen index, so the project's dependency on it is already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inference_service ./inference_service
COPY adapter_cache ./adapter_cache
RUN pip install . && python -c "import inference_service, adapter_cache"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG CPU_KERNELS=1
RUN if [ "${CPU_KERNELS}" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi
LABEL org.opencontainers.image.title="loraplex" \
      org.opencontainers.image.description="Multi-LoRA LLM inference service and adapter-cache sidecar"
# Fixed numeric ids: the chart's securityContext runs as 10001:10001 with runAsNonRoot.
RUN groupadd --system --gid 10001 loraplex \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin loraplex
COPY --from=build /opt/loraplex /opt/loraplex
# HOME=/tmp: the root filesystem is read-only in the pod; /tmp is an emptyDir.
ENV PATH=/opt/loraplex/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
# gRPC, inference metrics, sidecar metrics.
EXPOSE 50051 9400 9401
CMD ["loraplex-inference", "--help"]
