"""Generate the Python gRPC stubs from protos/ into the package `specd_core.api.v1`.

The .proto file lives at protos/specd_core/api/v1/ so that the generated modules
import each other as `specd_core.api.v1`; its proto package stays `specdec.v1`, the
name every client sees on the wire (service `specdec.v1.OrchestratorService`).

    python -m specd.protogen            # regenerate in place
    python -m specd.protogen --check    # exit 1 if the committed stubs are stale

The stubs are committed (so `pip install` needs no protoc step) and
tests/test_protos.py fails when they differ from what the .proto files generate.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
PROTOS = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))
STUBS = "specd_core/api/v1"
GENERATED = ["specdec_pb2.py", "specdec_pb2.pyi", "specdec_pb2_grpc.py"]


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in GENERATED:
            new, old = Path(tmp) / STUBS / name, ROOT / STUBS / name
            if not old.exists() or not filecmp.cmp(new, old, shallow=False):
                stale.append(f"{STUBS}/{name}")
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs (run `python -m specd.protogen`):", *stale, sep="\n  ")
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
