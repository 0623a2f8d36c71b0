"""An application's own tests, with a real Conveyor server inside the test process.

    uv run pytest examples/test_application.py

The quickstart worker (``examples/worker.py``) is the application: its handlers run
against an embedded server (``conveyor_cli.testing``) exactly as they would in
production, through the SDK's real clients and the worker's gRPC stream. In your own
project, put ``pytest_plugins = ["conveyor_cli.pytest_plugin"]`` in the top-level
``conftest.py`` and ask for the ``conveyor_server`` fixture; here it is imported.
"""

from __future__ import annotations

from conveyor import AsyncClient, Client, TaskState
from conveyor_cli.pytest_plugin import conveyor_server  # noqa: F401 - the fixture
from conveyor_cli.testing import BlockingEmbeddedServer

from examples.worker import worker


def test_a_welcome_email_is_delivered(conveyor_server: BlockingEmbeddedServer) -> None:  # noqa: F811
    with conveyor_server.running(worker), Client(conveyor_server.target) as client:
        task = client.enqueue(
            "email.send", {"to": "ada@example.com", "subject": "Hi"}, queue="emails"
        )
        done = conveyor_server.wait_for(task.id)
    assert done.state is TaskState.COMPLETED
    assert done.result == {"delivered_to": "ada@example.com"}
    assert done.progress == {"step": "sending"}


def test_a_bad_address_is_archived_without_retries(
    conveyor_server: BlockingEmbeddedServer,  # noqa: F811
) -> None:
    with conveyor_server.running(worker), Client(conveyor_server.target) as client:
        task = client.enqueue("email.send", {"to": "nobody"}, queue="emails", max_retry=5)
        done = conveyor_server.wait_for(task.id)
    assert done.state is TaskState.ARCHIVED
    assert done.retried == 0
    assert "not an address" in (done.last_error or "")


async def test_reports_are_built_and_the_queue_drains(
    conveyor_server: BlockingEmbeddedServer,  # noqa: F811
) -> None:
    with conveyor_server.running(worker, concurrency=2):
        async with AsyncClient(conveyor_server.target) as client:
            ids = [
                (await client.enqueue("report.build", {"name": f"r{i}"}, queue="reports")).id
                for i in range(5)
            ]
        conveyor_server.drain(queues=["reports"])
    for task_id in ids:
        assert conveyor_server.wait_for(task_id).state is TaskState.COMPLETED
