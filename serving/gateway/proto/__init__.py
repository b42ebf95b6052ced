"""The gateway's gRPC API (meshserve.gateway.v1: Jobs, GatewayAdmin) and generated stubs."""
