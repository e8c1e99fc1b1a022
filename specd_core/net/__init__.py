"""The gRPC edge every service shares: error -> status mapping, servers and
channels (grpc_util), TLS (security), bearer tokens (auth), proto <-> core
dataclass conversion (wire) and the model services' process entry
(service_main)."""
