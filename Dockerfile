# syntax=docker/dockerfile:1
# Two images from one file:
#   server: the rendezvous server, its dependencies only (no torch), non-root.
#   worker: a CPU worker with torch, for the compose "demo" profile.
FROM python:3.11-slim AS source
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY common ./common
COPY server ./server
COPY client ./client

FROM source AS server
RUN pip install --no-cache-dir /src \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin commctx \
    && install -d -o 10001 -g 10001 /var/lib/commctx
USER 10001
# Every interface: a container's loopback is reachable from nowhere else (the
# server's own default is 127.0.0.1). Without COMMCTX_AUTH_TOKENS or
# COMMCTX_TLS_CLIENT_CA it warns at start that it serves without authentication.
ENV COMMCTX_HOST=0.0.0.0 COMMCTX_PORT=50051 COMMCTX_STATE_DIR=/var/lib/commctx
VOLUME ["/var/lib/commctx"]
EXPOSE 50051 50052 50080
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 CMD ["commctx", "health"]
CMD ["commctx-server"]

FROM source AS worker
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "/src[worker]" \
    && useradd --system --uid 10001 --create-home commctx
COPY examples /app/examples
USER 10001
WORKDIR /app
CMD ["python", "/app/examples/allreduce.py"]
