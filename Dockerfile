# NeoX-Topo image: the project installed by the README's own install command (`make venv`) on top
# of a PyTorch image whose torch it keeps, with the C++ quantization kernels compiled in.
#
# BASE_IMAGE defaults to AMD's ROCm PyTorch image (Frontier-class MI250X/MI300 GPUs). Change it with
# --build-arg; for NVIDIA GPUs use a CUDA *devel* image (headers and nvcc for compiled kernels):
#   docker build -t neox-topo:rocm .
#   docker build -t neox-topo:cuda --build-arg BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-devel .
# Any base works whose `python3` has torch>=2.4; docs/install.md says how to run the image.
ARG BASE_IMAGE=rocm/pytorch:rocm6.4.4_ubuntu24.04_py3.12_pytorch_release_2.7.1
FROM ${BASE_IMAGE}

# System tools `make venv` and the C++ build need, which some base images lack (not Python packages).
USER root
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        make g++ ninja-build python3-venv \
    && rm -rf /var/lib/apt/lists/*

# A non-root user owns the project and the kernel cache. Pick its uid to match the owner of the
# data/checkpoint folders you mount (1001: ubuntu:24.04 images already have a uid 1000).
ARG NEOX_UID=1001
RUN useradd --create-home --uid "${NEOX_UID}" --shell /bin/bash neox \
    && mkdir -p /opt/neox-topo /opt/torch_extensions \
    && chown neox:neox /opt/neox-topo /opt/torch_extensions
WORKDIR /opt/neox-topo
USER neox

# Only what the install needs comes before it (megatron/ too: the editable install maps the
# package's folder), so a change to configs, tools, tests or docs does not re-run the install.
ENV PIP_NO_CACHE_DIR=1
COPY --chown=neox:neox pyproject.toml Makefile ./
COPY --chown=neox:neox requirements/ requirements/
COPY --chown=neox:neox megatron/ megatron/
# The README's install command. The base image's python3 has torch, so the venv inherits it
# (--system-site-packages) and the extras are .[test,rocm] on ROCm, .[test,gpu] on CUDA.
RUN make venv

# Compile the C++ kernels now, into a cache the non-root user can also write at run time: the build
# is for this CPU kind (-march=native, folder named after it); on another CPU it is rebuilt there.
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions
COPY --chown=neox:neox csrc/ csrc/
RUN .venv/bin/python -m megatron.ops.quant build

# The rest of the project (configs, tools, train.py, deepy.py, tests...); .dockerignore keeps out
# .git, .venv, data, checkpoints and logs.
COPY --chown=neox:neox . .
ENV PATH=/opt/neox-topo/.venv/bin:${PATH}

# Default: show the launcher's usage, not a training run. Example run: docs/install.md.
CMD ["python", "deepy.py", "--help"]
