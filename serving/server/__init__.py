"""The gRPC instance server (meshserve.v1.Inference + grpc.health.v1) and its client library."""
