"""Regenerates the checked-in Python code for the protocol.

Policy: the generated modules are committed next to the .proto (so neither the
server image nor a worker needs grpcio-tools), and tests/test_proto_drift.py
fails when they no longer match what this script produces.

Usage: python proto/regen.py
"""

from __future__ import annotations

import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PROTOS = ["commctx/v1/rendezvous.proto"]


def generate(out_dir: pathlib.Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for PROTOS under out_dir.

    Raises:
        RuntimeError: protoc reported an error.
    """
    import importlib.resources

    from grpc_tools import protoc  # a development dependency only

    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(PROTO_ROOT)
    sys.exit(0)
