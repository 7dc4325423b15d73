# mrtr-keys: the sealing sidecar and the CLI in one image (docs/deploy.md).
#   make sbom && docker build -t mrtr-keys:0.2.0 .
#   docker run --read-only -v ring:/etc/mrtr-keys:ro -v state:/var/lib/mrtr-keys -p 127.0.0.1:8750:8750 mrtr-keys:0.2.0
# Runs as the non-root user mrtr-keys (10001:10001) with a read-only root filesystem: the key ring and the
# client registry are read from /etc/mrtr-keys (mount them read-only), and the only writes go to the state
# directory /var/lib/mrtr-keys (audit key, default audit log, locks). Checked without a container runtime by
# tests/deploy/ (hadolint, and the image's command run as 10001 under the same constraints).
# What it installs is locked (docs/supply-chain.md): requirements/image.txt and requirements/build.txt, exported
# from uv.lock with every artifact's sha256 (pip --require-hashes). The build refuses an SBOM (build/sbom/, from
# `make sbom`) or a lock other than the one whose digest `make lock` wrote below; the image carries both SBOMs
# in /usr/share/doc/mrtr-keys/sbom/ and the digest as its label mrtr-keys.uv-lock.sha256.
ARG UV_LOCK_SHA256=4165334c665b21c07fb4db33ba04996d6f5ade7ac9609da14c4f973cdd6cb446

FROM python:3.11-slim-bookworm AS build
ARG UV_LOCK_SHA256
WORKDIR /src
COPY uv.lock ./
COPY requirements/build.txt requirements/image.txt ./requirements/
COPY build/sbom/python.cdx.json build/sbom/typescript.cdx.json ./sbom/
RUN printf '%s  uv.lock\n' "${UV_LOCK_SHA256}" > uv.lock.sha256 \
    && sha256sum --check --strict uv.lock.sha256 \
    && grep -q "\"${UV_LOCK_SHA256}\"" sbom/python.cdx.json \
    && python -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes -r requirements/build.txt
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/build/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation \
       --wheel-dir /wheels . \
    && python -m venv --without-pip /opt/mrtr-keys \
    && /opt/build/bin/pip --python /opt/mrtr-keys/bin/python install --no-cache-dir --disable-pip-version-check \
       --require-hashes -r requirements/image.txt \
    && /opt/build/bin/pip --python /opt/mrtr-keys/bin/python install --no-cache-dir --disable-pip-version-check \
       --no-deps /wheels/mrtr_keys-*.whl

FROM python:3.11-slim-bookworm
ARG UV_LOCK_SHA256
LABEL mrtr-keys.uv-lock.sha256="${UV_LOCK_SHA256}"
RUN groupadd --system --gid 10001 mrtr-keys \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/mrtr-keys --no-create-home \
       --shell /usr/sbin/nologin mrtr-keys \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/mrtr-keys \
    && install -d -o root -g root -m 0755 /etc/mrtr-keys
COPY --from=build /opt/mrtr-keys /opt/mrtr-keys
COPY --from=build /src/sbom /usr/share/doc/mrtr-keys/sbom
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
