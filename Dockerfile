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
#   CPU_KERNELS      1 (default): the build stage compiles the CPU kernels, every named ISA variant
#                    (`python -m inference_service.kernels.build --all`), into the installed package; the
#                    service picks the variant the node's CPU runs at start. 0: none (e.g. for CUDA images);
#                    the CPU ops then fall back to torch.
#   RUNTIME_COMPILER 0 (default): the runtime image has no C compiler. 1: it gets gcc, for the service's
#                    logged fallback of building a kernel at start where no prebuilt variant fits the CPU.
# Python packages: the project's dependencies as pip resolves them, less what pyproject.toml's
# [tool.loraplex.image] leave-out names (e.g. triton, which xgrammar requires and nothing here imports on a
# CPU) and whatever only those pull in (scripts/image_requirements.py); scripts/image_smoke_check.py then
# imports the servers and runs the structured-output path, so a package left out that is needed fails here.
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
COPY pyproject.toml README.md scripts/image_requirements.py scripts/image_smoke_check.py ./
# The dependencies first, in a layer of their own that a code change does not invalidate: pip resolves
# them (a dry run), the image keeps what is reachable without passing through a left-out package.
RUN pip install packaging \
 && python image_requirements.py requirements pyproject.toml >/tmp/requirements.txt \
 && pip install --dry-run --quiet --report /tmp/report.json --find-links /wheels -r /tmp/requirements.txt \
 && python image_requirements.py pins pyproject.toml /tmp/report.json >/tmp/pins.txt \
 && cat /tmp/pins.txt \
 && pip install --no-deps --find-links /wheels -r /tmp/pins.txt
ARG CPU_KERNELS=1
RUN if [ "${CPU_KERNELS}" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi
# The CPU kernels, every named ISA variant, built from their sources alone into /prebuilt: a layer that
# only a change to inference_service/kernels/ invalidates (a change elsewhere reuses it). On x86-64 the
# build fails if none came out (other architectures have no prebuilt variants: their kernels compile at
# run time where a compiler is).
COPY inference_service/__init__.py ./inference_service/__init__.py
COPY inference_service/kernels ./inference_service/kernels
RUN mkdir -p /prebuilt \
 && if [ "${CPU_KERNELS}" = "1" ]; then \
      LORAPLEX_KERNEL_PREBUILT=/prebuilt python -m inference_service.kernels.build --all \
      && if [ "$(uname -m)" = x86_64 ] && ! find /prebuilt -name '*.so' | grep -q .; then \
           echo "no prebuilt CPU kernels came out (CPU_KERNELS=0 builds without)" >&2; exit 1; \
         fi; \
    fi
COPY inference_service ./inference_service
COPY adapter_cache ./adapter_cache
# Checked from / with -P so that the installed package is what is imported (not /src's copy).
RUN pip install --no-deps . \
 && python image_requirements.py check /tmp/pins.txt \
 && cd / && python -P /src/image_smoke_check.py
# The prebuilt kernels into the installed package (kernels/prebuilt/<variant>/, keyed by the sources'
# contents, which the package holds unchanged); built by root, loaded by uid 10001: made world-readable.
RUN kernels="$(echo /opt/loraplex/lib/python3*/site-packages/inference_service/kernels)" \
 && if [ "${CPU_KERNELS}" = "1" ]; then \
      cp -r /prebuilt "$kernels/prebuilt" && chmod -R a+rX "$kernels/prebuilt"; \
    fi \
 && python -m pip uninstall -q -y pip

FROM ${BASE_IMAGE} AS runtime
ARG CPU_KERNELS=1
ARG RUNTIME_COMPILER=0
RUN if [ "${RUNTIME_COMPILER}" = "1" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi
LABEL org.opencontainers.image.title="loraplex" \
      org.opencontainers.image.description="Multi-LoRA LLM inference service and adapter-cache sidecar" \
      io.loraplex.cpu-kernels="${CPU_KERNELS}" \
      io.loraplex.runtime-compiler="${RUNTIME_COMPILER}"
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
