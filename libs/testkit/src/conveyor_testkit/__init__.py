"""Conveyor's test kit: what the workspace's tests share, kept out of every production
package (it is a development dependency of the workspace only).

- :mod:`conveyor_testkit.polling`: :func:`~conveyor_testkit.polling.wait_until` and its
  blocking twin ``wait_until_blocking``, the one way a test waits for a condition (never
  a fixed sleep).
- :mod:`conveyor_testkit.brokers`: brokers that count or misbehave for a test.
- :mod:`conveyor_testkit.stream`: a raw worker stream, a NATS recorder and a stand-in
  dispatcher, for driving an api server by hand.
- :mod:`conveyor_testkit.webhooks`: a real webhook endpoint and the :class:`Rig` around one
  webhook registration under test.
- :mod:`conveyor_testkit.fixtures`: pytest fixtures building the webhook rig.
"""
