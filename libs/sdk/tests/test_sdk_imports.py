"""How the SDK's modules depend on each other: no import circle, the worker and the
clients apart, and nothing from the server's packages."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import conveyor

PACKAGE = Path(conveyor.__file__).parent
#: What the SDK may import besides itself and the standard library.
THIRD_PARTY = {"conveyor_protos", "google", "grpc", "opentelemetry", "uvloop"}
#: The OpenTelemetry modules of opentelemetry-api: the SDK must work without the
#: OpenTelemetry SDK (the application's choice) installed.
OTEL_API = (
    "opentelemetry.trace",
    "opentelemetry.context",
    "opentelemetry.propagators",
    "opentelemetry.environment_variables",
)


def module_name(path: Path) -> str:
    parts = ["conveyor", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, TYPE_CHECKING and function-level imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sdk_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path) & set(modules) - {name} for name, path in modules.items()}


def test_the_graph_sees_the_known_edges() -> None:
    graph = sdk_graph()
    assert "conveyor._worker.session" in graph["conveyor._worker.worker"]
    assert "conveyor._clients.transport" in graph["conveyor._clients.producer"]


def test_no_import_circle() -> None:
    graph = sdk_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError(f"import circle: {' -> '.join(cycle)}")
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_worker_and_clients_stay_apart() -> None:
    for name, imported in sdk_graph().items():
        if name.startswith("conveyor._worker"):
            assert not any(m.startswith("conveyor._clients") for m in imported), name
        elif name.startswith("conveyor._clients"):
            assert not any(m.startswith("conveyor._worker") for m in imported), name
        elif name not in ("conveyor", "conveyor.webhooks"):
            # A shared module (errors, types, payloads...): below both.
            assert not any(
                m.startswith(("conveyor._worker", "conveyor._clients")) for m in imported
            ), name


def test_only_the_protos_and_grpc_besides_the_standard_library() -> None:
    for path in PACKAGE.rglob("*.py"):
        for imported in imports_of(path):
            top = imported.split(".")[0]
            assert top == "conveyor" or top in THIRD_PARTY or top in sys.stdlib_module_names, (
                f"{module_name(path)} imports {imported}"
            )


def test_only_the_opentelemetry_api() -> None:
    for path in PACKAGE.rglob("*.py"):
        for imported in imports_of(path):
            if imported.split(".")[0] != "opentelemetry" or imported == "opentelemetry":
                continue
            assert imported.startswith(OTEL_API), f"{module_name(path)} imports {imported}"
