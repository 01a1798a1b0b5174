# syntax=docker/dockerfile:1.7
# Slim control-plane image: gateway, admission, router, kvtransfer, sandbox (and `k3` itself).
#   docker build -f docker/control-plane.Dockerfile -t ghcr.io/k3serve/k3-control-plane:0.1.0 .
# torch: the gateway imports it through k3core.cache.hashing (prefix-cache block hashes), so the image carries
# the CPU wheel (~200 MB) instead of the CUDA build (~3 GB). admission, router and kvtransfer import no torch;
# if the gateway stops needing it, the torch layer can go.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir setuptools==84.2.1
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY k3core ./k3core
COPY kernels ./kernels
COPY services ./services
COPY bench ./bench
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# The CPU-only torch wheel comes from PyTorch's own wheel index (its `whl/cpu` URL), not from the default
# index: pass it with --build-arg TORCH_INDEX_URL=...; the build stops with that hint when it is missing.
ARG TORCH_INDEX_URL
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    K3_HOME=/tmp/k3
# tini reaps children (sandbox processes) and forwards SIGTERM so the service drains; bubblewrap isolates
# sandboxes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 bubblewrap=0.8.0-2+deb12u1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 k3 \
 && useradd --system --uid 10001 --gid k3 --create-home --home-dir /home/k3 --shell /usr/sbin/nologin k3
COPY docker/constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir --constraint /tmp/constraints.txt \
      --extra-index-url "${TORCH_INDEX_URL:?pass --build-arg TORCH_INDEX_URL (the PyTorch CPU wheel index)}" \
      torch==2.13.0+cpu
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --constraint /tmp/constraints.txt /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/constraints.txt \
 && k3 --help > /dev/null
USER 10001:10001
WORKDIR /home/k3
EXPOSE 50051 9090 8080
# Docker/Podman health; Kubernetes uses its native gRPC probe on the same grpc.health.v1 service.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["k3", "health", "--address", "localhost:50051"]
ENTRYPOINT ["tini", "--", "k3"]
CMD ["serve", "--help"]
