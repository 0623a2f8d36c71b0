"""The worker: a :class:`~conveyor._worker.worker.Worker` keeps one WorkerService.Session
stream open (``session``), runs each delivery it receives as an ``execution`` with its
``context``, and writes what they produce through the session's ``outbox``."""
