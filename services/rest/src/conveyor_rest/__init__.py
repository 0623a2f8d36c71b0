"""Conveyor's REST admin API: FastAPI in front of the api service's gRPC."""
