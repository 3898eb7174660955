# syntax=docker/dockerfile:1
# One image for both containers of the pod (helm/loraplex): the inference service runs
# `loraplex-inference`, the adapter-cache sidecar runs `loraplex-cache`.
#
# Build args (the defaults are the public sources; scripts/build_image.sh overrides them to build
# without a container registry or the PyTorch index, from Debian's packages and PyPI):
#   BASE_IMAGE       a Debian bookworm image with Python 3.11+, `python` on PATH and the venv module.
#                    Default: python:3.11-slim-bookworm.
#   TORCH_INDEX_URL  wheel index for torch. CPU (default): https://download.pytorch.org/whl/cpu
#                    CUDA: https://download.pytorch.org/whl/cu128 (the CUDA runtime ships inside the
#                    wheels; the node only needs the NVIDIA driver and container toolkit).
#   TORCH_VERSION    torch version, e.g. 2.13.0 (or 2.13.0+cpu to take only a local wheel, below).
#   Local wheels:    any *.whl in the context's build/image-wheels/ is offered to pip too (the build
#                    script copies the torch wheel on disk there; empty in a plain clone).
#   PIP_CERT, PIP_INDEX_URL  pip's CA bundle (e.g. a host bundle mounted with -v) and index, in the build.
#   CPU_KERNELS      1 (default): the runtime image gets a C compiler, with which the inference
#                    service builds its CPU kernels at first start for the node's own CPU
#                    (-march=native), into $LORAPLEX_KERNEL_CACHE (the chart points it at an emptyDir
#                    only the inference container mounts, since the process dlopen()s what is there).
#                    0: no compiler (e.g. for CUDA images); the CPU ops then fall back to torch.
# Examples:
#   docker build -t loraplex:cpu .
#   docker build -t loraplex:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg CPU_KERNELS=0 .
#   scripts/build_image.sh            # this project's CI: podman, a debootstrap base, the local torch wheel

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_CERT
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loraplex/bin:$PATH
RUN python -m venv /opt/loraplex
# torch first, from the chosen index (or a local wheel), so the project's dependency on it is already
# satisfied and `pip install .` cannot pull another build of it.
COPY build/image-wheel[s] /wheels/
# torch/test holds torch's own C++ test binaries (83 MB), never run here.
RUN mkdir -p /wheels \
 && pip install --index-url "${TORCH_INDEX_URL}" --find-links /wheels "torch==${TORCH_VERSION}" \
 && rm -rf /opt/loraplex/lib/python3*/site-packages/torch/test
WORKDIR /src
COPY pyproject.toml README.md ./
# The dependencies first, in a layer of their own that a code change does not invalidate.
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
      >/tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY inference_service ./inference_service
COPY adapter_cache ./adapter_cache
RUN pip install --no-deps . && pip check \
 && python -c "import torch, inference_service, adapter_cache; print('torch', torch.__version__)" \
 && python -m pip uninstall -q -y pip

FROM ${BASE_IMAGE} AS runtime
ARG CPU_KERNELS=1
RUN if [ "${CPU_KERNELS}" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; \
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
# gRPC, HTTP, inference metrics, sidecar metrics.
EXPOSE 50051 8000 9400 9401
CMD ["loraplex-inference", "--help"]
