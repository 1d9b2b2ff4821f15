"""Control plane: the `KVTransfer` gRPC service's shared pieces (both sides import these).

The service (`ctx.control_server`, on a ctx worker) negotiates transfers (RequestShard), stops
them (Cancel) and confirms them (Acknowledge); the bytes move over UCX, or are copied by the
receiver out of the pools it opened once through DescribePools (CUDA IPC, see `cuda_ipc`). Its
client (`gen.control_client`, on gen ranks) bounds every call by a deadline.

Trust (:mod:`.control_auth`): with the deployment's internal secret configured, the service
answers only calls carrying it; TLS (grpc's credentials) is optional. UCX does not validate the
worker addresses it is handed (a malformed one can abort the process), so the service must not
be reachable from outside the deployment's private network either way.

Stubs: `helixserve/protocol/transfer_pb2*.py` are generated from `transfer.proto` by
`python -m helixserve.transceiver.control --regenerate` (grpcio-tools; the generated code needs
grpcio >= 1.85.1 and protobuf >= 7.35.1, < 8 at runtime). A unit test checks they are current.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc

from helixserve.protocol.disagg import TransceiverEndpoint

PROTO = Path(__file__).resolve().parents[1] / "protocol" / "transfer.proto"
GENERATED = ("transfer_pb2.py", "transfer_pb2.pyi", "transfer_pb2_grpc.py")


def target(endpoint: TransceiverEndpoint) -> str:
    return f"{endpoint.host}:{endpoint.port}"


def rpc_error_text(error: BaseException) -> str:
    """A short cause for a failed call (status code and details for gRPC errors)."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def generate_stubs(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on transfer.proto; returns the generated files under `out_dir`."""
    from grpc_tools import protoc  # dev dependency: only to regenerate

    root = PROTO.parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{root}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", str(PROTO.relative_to(root))]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        made = Path(tmp) / "helixserve" / "protocol"
        return [Path(shutil.copy(made / name, out_dir / name)) for name in GENERATED]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="regenerate the KVTransfer gRPC stubs")
    parser.add_argument("--regenerate", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=PROTO.parent)
    args = parser.parse_args(argv)
    for path in generate_stubs(args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
