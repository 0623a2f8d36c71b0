"""The clients of the server's unary services: the producer clients (TaskService), the
admin clients (AdminService), the webhook callbacks (WebhookService), their wire
conversions and the gRPC transport they share.

Each asyncio client is written by hand; its blocking twin is generated from it by
scripts/gen_sync_clients.py.
"""
