"""The SDK checks the server's input rules before sending (to fail at the line that caused
it): its copies must stay equal to the server's."""

from __future__ import annotations

from conveyor import _limits as sdk
from conveyor_api import session
from conveyor_broker import validation


def test_the_sdk_checks_the_servers_limits() -> None:
    assert sdk.QUEUE_RE.pattern == validation.QUEUE_RE.pattern
    assert sdk.CONTROL_RE.pattern == validation.CONTROL_RE.pattern
    assert sdk.MAX_TYPE_LEN == validation.MAX_TYPE_LEN
    assert sdk.MAX_KEY_LEN == validation.MAX_KEY_LEN
    assert sdk.MAX_HELLO_QUEUES == session.MAX_QUEUES
    assert sdk.MAX_QUEUE_WEIGHT == session.MAX_QUEUE_WEIGHT
    assert sdk.MAX_CONCURRENCY == session.MAX_CONCURRENCY
    assert sdk.MAX_LABELS == session.MAX_LABELS
    assert sdk.MAX_LABEL_KEY_LEN == session.MAX_LABEL_KEY_LEN
    assert sdk.MAX_LABEL_VALUE_LEN == session.MAX_LABEL_VALUE_LEN
    assert sdk.MAX_WORKER_ID_LEN == session.MAX_WORKER_ID_LEN
    assert sdk.MAX_VERSION_LEN == session.MAX_VERSION_LEN
