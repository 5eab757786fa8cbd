# kvserve: CPU image by default. For CUDA, build with a CUDA base and the matching torch wheel index, e.g.
#   docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 --build-arg TORCH_INDEX=<cuda wheel index> .
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVSERVE_HOME=/models \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

# g++: kvserve builds its quantized kernels for the CPU it runs on, and inductor compiles the decode step, both at
# load (cached under $KVSERVE_HOME). Without it the server still runs, on torch's kernels, eagerly.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 kvserve && mkdir -p /models /app && chown kvserve /models /app
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY weights ./weights
COPY server ./server
COPY bench ./bench
RUN if [ -n "$TORCH_INDEX" ]; then pip install --extra-index-url "$TORCH_INDEX" .; else pip install .; fi

USER 10001
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVSERVE_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "server"]
