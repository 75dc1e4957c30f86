"""Build hook: generate the gRPC/protobuf stubs from protos/ at build and install time.

The stubs are never committed; they are written to policy_service/_generated/ before the
regular build_py step copies the package, so both wheels and editable installs carry them.
"""
from __future__ import annotations

import pathlib
import re

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "policy_service" / "_generated"


def generate_stubs() -> None:
    from grpc_tools import protoc  # build requirement
    import importlib.resources

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={OUT}",
            f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    # Make every package importable and the generated imports package-relative.
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    for f in OUT.rglob("*_pb2*.py"):
        text = f.read_text()
        fixed = re.sub(r"^from swapaware\.(\S+) import", r"from policy_service._generated.swapaware.\1 import",
                       text, flags=re.M)
        f.write_text(fixed)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


# Generate before setup() so package discovery sees policy_service._generated.*.
generate_stubs()
setup(cmdclass={"build_py": BuildPyWithProtos})
