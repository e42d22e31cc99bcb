# syntax=docker/dockerfile:1
#
# gpu-node-agent: the device plugin, MIG manager, node labeller and GPU health reporter for one GPU
# node, run by daemonset/.
#
#   docker build -t gpu-node-agent:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/gpu-node-agent:0.1.0 --push .
#
# The image carries no NVIDIA library. The NVIDIA Container Toolkit on the node injects the driver's
# libnvidia-ml.so.1 (and nvidia-smi) and the GPU device nodes when it starts the container, as asked
# by NVIDIA_VISIBLE_DEVICES and NVIDIA_DRIVER_CAPABILITIES below. Without the toolkit the agent
# still runs its simulated modes (gpu-agent simulate, --nvml mock:...).
#
# For reproducible builds pin the base image by digest:
#   --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:<digest>
# Any Debian or Ubuntu image with python3 and python3-venv works as the base too (hack/cluster builds
# the image on one made locally with mmdebstrap).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_INPUT=1
WORKDIR /src

# The build backend for the agent's own wheel, pinned and hash-checked, in a virtual environment of
# its own that stays in this stage. Not in the base image's Python: Debian's and Ubuntu's python3 are
# marked externally managed (PEP 668) and refuse pip installs; python:3.11-slim just has no marker.
COPY requirements-build.lock ./
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements-build.lock

# Runtime dependencies, every file checked against the lock's hashes. Wheels only: nothing is
# compiled, so no compiler is needed here or present in the image.
COPY requirements.lock ./
RUN python -m venv /opt/gpu-node-agent \
 && /opt/gpu-node-agent/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements.lock

# The agent, built from this source tree. Its dependencies all came from the lock (--no-deps);
# pip check fails the build if the lock no longer satisfies pyproject.toml. pip and setuptools are
# then removed from the environment that ships, and its bytecode is compiled in unchecked-hash mode
# so it stays valid whatever timestamps the image layers end up with: with a read-only root
# filesystem Python could not rewrite stale bytecode and would recompile on every start.
COPY pyproject.toml README.md ./
COPY agent/ agent/
RUN /opt/build/bin/pip wheel --no-build-isolation --no-deps --wheel-dir /tmp/wheels . \
 && /opt/gpu-node-agent/bin/pip install --no-deps /tmp/wheels/gpu_node_agent-*.whl \
 && /opt/gpu-node-agent/bin/pip check \
 && /opt/gpu-node-agent/bin/pip uninstall --yes pip setuptools \
 && /opt/gpu-node-agent/bin/python -m compileall -f -q -j 0 --invalidation-mode unchecked-hash \
      /opt/gpu-node-agent/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpu-node-agent" \
      org.opencontainers.image.description="Kubernetes GPU node agent: device plugin, MIG manager, node labels, GPU health" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0"
COPY --from=build /opt/gpu-node-agent /opt/gpu-node-agent
ENV PATH=/opt/gpu-node-agent/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# root, deliberately. Changing a GPU's MIG mode is a privileged NVIDIA driver call that needs
# CAP_SYS_ADMIN, the MIG config capability device is readable by root only, and the kubelet's
# device-plugin and pod-resources sockets belong to root. Kubernetes gives added capabilities only to
# a root process (it sets no ambient capabilities), so a non-root agent could do none of this.
# The DaemonSet drops every other capability and keeps the root filesystem read-only (SECURITY.md).
# hadolint ignore=DL3002
USER 0:0
EXPOSE 9400
ENTRYPOINT ["gpu-agent"]
CMD ["run"]
