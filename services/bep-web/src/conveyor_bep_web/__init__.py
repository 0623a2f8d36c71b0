"""Conveyor for builds: the web UI over the build-event ingest's store."""
