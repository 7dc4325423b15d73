# mrtr-keys: the sealing sidecar and the CLI in one image (docs/deploy.md).
#   docker build -t mrtr-keys:0.1.0 .
#   docker run --read-only -v ring:/etc/mrtr-keys:ro -v state:/var/lib/mrtr-keys -p 127.0.0.1:8750:8750 mrtr-keys:0.1.0
# Runs as the non-root user mrtr-keys (10001:10001) with a read-only root filesystem: the key ring and the
# client registry are read from /etc/mrtr-keys (mount them read-only), and the only writes go to the state
# directory /var/lib/mrtr-keys (audit key, default audit log, locks). Checked without a container runtime by
# tests/deploy/ (hadolint, and the image's command run as 10001 under the same constraints).

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m venv /opt/mrtr-keys \
    && /opt/mrtr-keys/bin/pip install --no-cache-dir --disable-pip-version-check ".[all]"

FROM python:3.11-slim-bookworm
RUN groupadd --system --gid 10001 mrtr-keys \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/mrtr-keys --no-create-home \
       --shell /usr/sbin/nologin mrtr-keys \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/mrtr-keys \
    && install -d -o root -g root -m 0755 /etc/mrtr-keys
COPY --from=build /opt/mrtr-keys /opt/mrtr-keys
ENV PATH=/opt/mrtr-keys/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/mrtr-keys \
    MRTR_KEYS_KEYSTORE=/etc/mrtr-keys/keyring.json \
    MRTR_KEYS_CLIENTS=/etc/mrtr-keys/clients.json \
    MRTR_KEYS_STATE_DIR=/var/lib/mrtr-keys \
    MRTR_KEYS_HOST=0.0.0.0 \
    MRTR_KEYS_PORT=8750 \
    MRTR_KEYS_LOG_FORMAT=json
WORKDIR /var/lib/mrtr-keys
USER 10001:10001
VOLUME ["/var/lib/mrtr-keys"]
EXPOSE 8750
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["mrtr-keys", "health"]
ENTRYPOINT ["mrtr-keys"]
CMD ["serve"]
