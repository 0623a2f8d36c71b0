"""Bazel Build Event Protocol ingest."""
