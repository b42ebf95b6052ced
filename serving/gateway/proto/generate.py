"""Regenerates gateway_pb2.py, gateway_pb2.pyi and gateway_pb2_grpc.py from gateway.proto (needs grpcio-tools).
Run from anywhere: `python -m serving.gateway.proto.generate`."""
from __future__ import annotations

import sys

from serving.wire.generate import REPO_ROOT, generate_stubs, main

PROTO = "serving/gateway/proto/gateway.proto"
GENERATED = ("gateway_pb2.py", "gateway_pb2.pyi", "gateway_pb2_grpc.py")


def generate(out_root: str = REPO_ROOT) -> list[str]:
    """Writes the stubs under out_root/serving/gateway/proto/ (imports stay `serving.*.proto.*`)."""
    return generate_stubs(PROTO, out_root)


if __name__ == "__main__":
    sys.exit(main(generate))
