"""Regenerates gateway_pb2.py, gateway_pb2.pyi and gateway_pb2_grpc.py from gateway.proto (needs grpcio-tools).
Run from anywhere: `python -m serving.gateway.proto.generate`."""
from __future__ import annotations

import os
import sys

PROTO = "serving/gateway/proto/gateway.proto"
GENERATED = ("gateway_pb2.py", "gateway_pb2.pyi", "gateway_pb2_grpc.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def generate(out_root: str = REPO_ROOT) -> list[str]:
    """Writes the stubs under out_root/serving/gateway/proto/ (imports stay `serving.*.proto.*`)."""
    from grpc_tools import protoc
    os.makedirs(os.path.join(out_root, os.path.dirname(PROTO)), exist_ok=True)
    rc = protoc.main(["protoc", f"-I{REPO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
                      f"--grpc_python_out={out_root}", os.path.join(REPO_ROOT, PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    return [os.path.join(out_root, os.path.dirname(PROTO), name) for name in GENERATED]


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
