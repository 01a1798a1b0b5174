"""Generate the Python stubs for protos/k3/v1 (messages, gRPC services and typed .pyi stubs).

    python protos/generate.py           # write stubs beside the .proto files
    python protos/generate.py --check   # fail if the committed stubs are stale (CI)

Stubs are committed so a plain `pip install` needs no protoc; CI regenerates and compares.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "k3" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    # protoc-gen-mypy lives in the venv's bin; make sure protoc can find it.
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "k3" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(PROTO_ROOT)
        print(f"generated {len(generated_files(PROTO_ROOT))} files in {PACKAGE_DIR}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp_root = Path(tmp)
        (tmp_root / "k3" / "v1").mkdir(parents=True)
        generate(tmp_root)
        fresh = {p.name: p for p in generated_files(tmp_root)}
        committed = {p.name: p for p in generated_files(PROTO_ROOT)}
        stale = sorted(set(fresh) ^ set(committed))
        stale += [n for n in sorted(set(fresh) & set(committed)) if not filecmp.cmp(fresh[n], committed[n], False)]
        if stale:
            raise SystemExit("stale generated stubs (run `python protos/generate.py`): " + ", ".join(stale))
        shutil.rmtree(tmp_root / "k3")
    print("generated stubs are fresh")


if __name__ == "__main__":
    main()
