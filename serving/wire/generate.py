"""Regenerates meshserve_pb2.py, meshserve_pb2.pyi and meshserve_pb2_grpc.py from meshserve.proto (needs
grpcio-tools). Run from anywhere: `python -m serving.wire.generate`. `generate_stubs` and `main` are shared
with the gateway's proto/generate.py."""
from __future__ import annotations

import os
import re
import sys

PROTO = "serving/wire/meshserve.proto"
GENERATED = ("meshserve_pb2.py", "meshserve_pb2.pyi", "meshserve_pb2_grpc.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_stubs(proto: str, out_root: str = REPO_ROOT) -> list[str]:
    """Runs protoc on `proto` (a repo-relative path) and writes the _pb2, .pyi and _pb2_grpc files beside it under
    out_root (their imports follow the proto's path: `serving.wire.*`); returns their paths."""
    from grpc_tools import protoc
    os.makedirs(os.path.join(out_root, os.path.dirname(proto)), exist_ok=True)
    rc = protoc.main(["protoc", f"-I{REPO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
                      f"--grpc_python_out={out_root}", os.path.join(REPO_ROOT, proto)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
    stem = os.path.splitext(os.path.basename(proto))[0]
    return [os.path.join(out_root, os.path.dirname(proto), f"{stem}{suffix}")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def stub_content(text: str) -> str:
    """A generated stub without the tool and runtime versions stamped into it (they differ between machines that
    generate the same content): what `tests` compare with the committed stubs."""
    text = re.sub(r"# Protobuf Python Version: .*", "", text)
    text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", "", text)
    return re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "", text)


def main(write_stubs) -> int:
    """A `python -m ...generate` run: calls `write_stubs()` (a module's `generate`) and prints the paths it
    wrote; returns 0."""
    for path in write_stubs():
        print(path)
    return 0


def generate(out_root: str = REPO_ROOT) -> list[str]:
    """Writes the stubs under out_root/serving/wire/ (imports stay `serving.wire.*`)."""
    return generate_stubs(PROTO, out_root)


if __name__ == "__main__":
    sys.exit(main(generate))
