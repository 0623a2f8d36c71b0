# Sourced by scripts/test and scripts/run: find uv, installing it from PyPI if missing.
export UV_PYTHON_DOWNLOADS=never
if command -v uv >/dev/null 2>&1; then
  UV=(uv)
else
  python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv>=0.5"
  UV=(python3 -m uv)
fi
