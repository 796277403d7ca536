# sentinel-node in a container: a stage on a home GPU (the default, CUDA) or any role on a CPU.
#
#   docker build -t sentinel-node:cuda .
#   docker build --build-arg VARIANT=cpu -t sentinel-node:cpu .
#
# The entry point is `sentinel-node`; /data (the working directory and $HOME) keeps identities, checkpoints and
# caches. It runs as the unprivileged user `sentinel` (uid $USER_UID). Ports: 31337 p2p (pass --host-maddrs
# /ip4/0.0.0.0/tcp/31337), 9400 Prometheus metrics (--metrics-port 9400).
#
# The cuda variant needs no CUDA in the base image: PyPI's torch wheels for Linux x86_64 are CUDA builds (torch
# 2.13.0: CUDA 13.0) that bring CUDA's runtime libraries (cuBLAS, cuDNN, NCCL, ...) as nvidia-* pip packages, and
# bitsandbytes ships a binary for each CUDA version. Only the driver comes from the host, at run time: the NVIDIA
# Container Toolkit mounts it with `docker run --gpus all` (CUDA 13.0 needs driver 580 or newer).
#
# Build arguments:
#   VARIANT          cuda: torch's CUDA build plus bitsandbytes (the [gpu] extra); cpu: torch's CPU build.
#   BASE_IMAGE       a Debian or Ubuntu image with Python >= 3.11 (default debian:bookworm-slim, Python 3.11);
#                    python3 and python3-venv are installed with apt when missing. For an nvidia/cuda base pass
#                    e.g. nvidia/cuda:12.8.1-runtime-ubuntu24.04 (Python 3.12; not built by the project's scripts,
#                    whose machine cannot pull it); torch still loads the CUDA libraries of its own wheels.
#   TORCH_VERSION    the project accepts torch <= 2.13.0.
#   TORCH_CUDA_INDEX where the cuda variant's torch comes from: empty (the default) for PyPI's, or a PyTorch index
#                    for another CUDA build (e.g. https://download.pytorch.org/whl/cu128 for drivers older than 580).
#   BITSANDBYTES_VERSION the bitsandbytes the cuda variant installs (the one scripts/image_cuda.sh checked).
#   WHEELS           a folder of wheels inside the build (e.g. `buildah bud --volume DIR:/wheels --build-arg
#                    WHEELS=/wheels`): install from it alone, offline, instead of the package indexes.
#   USER_UID         the user's uid; match your own to write to a bind-mounted /data.
#   CA_BUNDLE        a CA certificate bundle inside the build that pip's downloads trust (behind a TLS-intercepting
#                    proxy; scripts/image_cuda.sh mounts its machine's with `--volume` and passes this).
# scripts/image_smoke.sh builds the cpu variant with buildah and runs it (tests/test_image.py); scripts/image_cuda.sh
# (make image-cuda) builds the cuda variant on a debootstrapped Debian from PyPI and checks it on a machine without
# a GPU.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG BITSANDBYTES_VERSION=0.50.2
ARG WHEELS=
ARG USER_UID=1000
ARG CA_BUNDLE=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python in a venv (Debian and Ubuntu mark the system one as externally managed).
RUN set -eu; \
    if ! python3 -m venv /opt/venv 2>/dev/null; then \
        rm -rf /opt/venv; \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
        python3 -m venv /opt/venv; \
    fi; \
    python3 --version

# torch first, from the index of the variant (or WHEELS), so the project's dependencies find it satisfied; an empty
# index is pip's own (PyPI).
RUN set -eu; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    case "$VARIANT" in \
        cuda) index="$TORCH_CUDA_INDEX" ;; \
        cpu) index="$TORCH_CPU_INDEX" ;; \
        *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    if [ -n "$WHEELS" ]; then source="--no-index --find-links $WHEELS"; \
    elif [ -n "$index" ]; then source="--index-url $index"; else source=""; fi; \
    pip install --no-cache-dir --no-compile $source "torch==$TORCH_VERSION"; \
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# The project's dependencies (from pyproject.toml alone, so this layer stays cached while the code changes);
# hivemind from its wheel only (it bundles the p2pd daemon).
COPY pyproject.toml /opt/sentinel-node/pyproject.toml
RUN set -eu; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    if [ -n "$WHEELS" ]; then source="--no-index --find-links $WHEELS"; else source=""; fi; \
    extras=""; if [ "$VARIANT" = cuda ]; then extras="gpu"; fi; \
    python -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for e in sys.argv[2:] for r in p["optional-dependencies"][e]]))' \
        /opt/sentinel-node/pyproject.toml $extras > /tmp/requirements.txt; \
    if [ "$VARIANT" = cuda ]; then echo "bitsandbytes==$BITSANDBYTES_VERSION" >> /tmp/requirements.txt; fi; \
    cat /tmp/requirements.txt; \
    pip install --no-cache-dir --no-compile $source --only-binary hivemind -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt

# The project itself, editable (configs/ links to the package's own sentinel_node/configs/). Bytecode only for what
# the commands import (scripts/compile_imports.py): the pip installs above compile nothing, where compiling every file
# took 360 MB and most of the build's CPU time for modules no node imports.
COPY . /opt/sentinel-node
RUN set -eu; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    if [ -n "$WHEELS" ]; then source="--no-index --find-links $WHEELS"; else source=""; fi; \
    pip install --no-cache-dir --no-compile $source --no-deps -e /opt/sentinel-node; \
    home="$(mktemp -d)"; HOME="$home" python /opt/sentinel-node/scripts/compile_imports.py; rm -rf "$home"; \
    pip check

# An unprivileged user whose home is the data volume (Ubuntu's images already hold a user with uid 1000). /swarm is
# for files the nodes of a local swarm share (docker-compose.yml mounts one volume there, owned by this user).
RUN set -eu; \
    existing="$(getent passwd "$USER_UID" | cut -d: -f1)"; \
    if [ -n "$existing" ]; then userdel "$existing"; rm -rf "/home/$existing"; fi; \
    useradd --uid "$USER_UID" --user-group --home-dir /data --no-create-home --shell /bin/sh sentinel; \
    mkdir -p /data /swarm; \
    chown sentinel:sentinel /data /swarm

# Metrics listen on every interface of the container (a node outside one binds 127.0.0.1 by default): publishing
# the port (-p 127.0.0.1:9400:9400) decides who reaches them.
ENV HOME=/data \
    XDG_CACHE_HOME=/data/cache \
    HF_HOME=/data/cache/huggingface \
    SENTINEL_METRICS_HOST=0.0.0.0
USER sentinel
WORKDIR /data
VOLUME ["/data"]
EXPOSE 31337 9400
ENTRYPOINT ["sentinel-node"]
CMD ["--help"]
