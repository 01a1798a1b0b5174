# syntax=docker/dockerfile:1.7
# GPU worker image: prefill, decode, trainer on CUDA (torch 2.13.0's PyPI build is CUDA 13.0).
#   docker build -f docker/gpu-worker.Dockerfile -t ghcr.io/k3serve/k3-gpu-worker:0.1.0 .
# The CUDA user-space libraries come with the torch wheel (cuda-toolkit 13.0.3 from PyPI); the base image
# supplies the CUDA environment the NVIDIA container toolkit expects, the driver comes from the node.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
ARG BUILD_IMAGE=python:3.12.12-slim-bookworm

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir setuptools==84.2.1
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY k3core ./k3core
COPY kernels ./kernels
COPY services ./services
COPY bench ./bench
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${CUDA_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/k3/bin:${PATH} \
    K3_HOME=/tmp/k3 \
    TRITON_CACHE_DIR=/tmp/triton-cache \
    XDG_CACHE_HOME=/tmp/cache
# Triton compiles its launcher with the system C compiler at first use, hence gcc and the Python headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.12=3.12.3-1ubuntu0.* python3.12-venv=3.12.3-1ubuntu0.* python3.12-dev=3.12.3-1ubuntu0.* \
      gcc=4:13.2.0-* libc6-dev=2.39-* tini=0.19.0-* ca-certificates=2024* \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/k3 \
 && groupadd --system --gid 10001 k3 \
 && useradd --system --uid 10001 --gid k3 --create-home --home-dir /home/k3 --shell /usr/sbin/nologin k3
COPY docker/constraints.txt /tmp/constraints.txt
# torch pins triton 3.7.1 for CUDA; the `kernels` extra's triton 3.9.0 pin is for the CPU interpreter only.
RUN pip install --no-cache-dir --constraint /tmp/constraints.txt torch==2.13.0
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --constraint /tmp/constraints.txt /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/constraints.txt \
 && k3 --help > /dev/null
USER 10001:10001
WORKDIR /home/k3
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=1800s --retries=3 \
  CMD ["k3", "health", "--address", "localhost:50051"]
ENTRYPOINT ["tini", "--", "k3"]
CMD ["serve", "--help"]
