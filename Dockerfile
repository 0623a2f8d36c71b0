# One image for every Conveyor service: `conveyor serve <api|dispatcher|maintenance|webhook|rest>`,
# `conveyor migrate`, `conveyor dev`.
FROM python:3.11-slim AS build
RUN pip install --no-cache-dir "uv>=0.5"
WORKDIR /src
ENV UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
COPY . .
RUN uv sync --frozen --no-dev --no-editable

FROM python:3.11-slim
RUN useradd --system --uid 10001 conveyor
COPY --from=build /src/.venv /app/.venv
ENV PATH="/app/.venv/bin:$PATH" PYTHONUNBUFFERED=1
USER conveyor
EXPOSE 50051 8080
ENTRYPOINT ["conveyor"]
CMD ["--help"]
