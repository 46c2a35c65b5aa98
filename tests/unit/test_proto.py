"""The committed generated protobuf module must match what proto/ generates today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto_sources(tmp_path):
    sources = sorted((ROOT / "proto").glob("*.proto"))
    assert sources, "proto/ has no .proto files"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
         *map(str, sources)],
        check=True,
    )
    for source in sources:
        name = source.stem + "_pb2.py"
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "p2ptrain" / "proto" / name).read_text()
        assert committed == fresh, (
            f"p2ptrain/proto/{name} is stale; regenerate it: "
            f"python -m grpc_tools.protoc -Iproto --python_out=p2ptrain/proto {source.relative_to(ROOT)}"
        )
