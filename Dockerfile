# One image for every Conveyor service: `conveyor serve <api|dispatcher|maintenance|webhook|rest|bep|bep-web>`,
# `conveyor migrate`, `conveyor bep ...`, `conveyor dev`.
FROM python:3.11-slim AS build
RUN pip install --no-cache-dir "uv>=0.5"
WORKDIR /src
ENV UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
COPY . .
# The build-event ingest's Bazel protos are generated, not committed: from Debian's
# bazel-bootstrap-source (apt) with grpcio-tools, into conveyor_bep.bazel, which the
# install below then packages.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends dpkg \
    && uv sync --frozen --no-dev --no-install-workspace \
    && uv run --no-sync --with grpcio-tools python scripts/bep_protos.py \
    && rm -rf /var/lib/apt/lists/*
RUN uv sync --frozen --no-dev --no-editable

FROM python:3.11-slim
RUN useradd --system --uid 10001 conveyor \
    && mkdir -p /var/lib/conveyor-bep && chown conveyor:conveyor /var/lib/conveyor-bep
# /var/lib/conveyor-bep: the build-event CAS sink's blobs (compose mounts a volume there,
# which takes this directory's owner).
COPY --from=build /src/.venv /app/.venv
ENV PATH="/app/.venv/bin:$PATH" PYTHONUNBUFFERED=1
USER conveyor
EXPOSE 50051 8080 8985 8986
ENTRYPOINT ["conveyor"]
CMD ["--help"]
