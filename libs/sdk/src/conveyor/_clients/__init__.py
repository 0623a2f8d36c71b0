"""The clients of the server's unary services: the producer clients (TaskService), the
admin clients (AdminService), their wire conversions and the gRPC transport they share."""
