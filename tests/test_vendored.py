"""The repository stands alone: data the tests and the demo use is vendored, and the copies
must stay equal to the shared originals whenever those are beside the repository."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
COPIES = {
    REPO / "tests" / "data" / "kv_events.json": "vectors/kv_events.json",
    REPO / "tests" / "data" / "rfc1527_mooncake.json": "vectors/rfc1527_mooncake.json",
    REPO / "src" / "kvwire" / "sim" / "data" / "synthetic_trace.jsonl": "traces/synthetic_trace.jsonl",
}


def test_vendored_files_are_present_and_parse() -> None:
    vectors = json.loads((REPO / "tests" / "data" / "kv_events.json").read_text())["vectors"]
    assert {v["dialect"] for v in vectors} >= {"vllm", "sglang", "vllm-legacy", "vllm-legacy-v0"}
    rfc = json.loads((REPO / "tests" / "data" / "rfc1527_mooncake.json").read_text())
    assert len(rfc["messages"]) == 69 and "Mooncake" in rfc["source"]
    trace = resources.files("kvwire.sim") / "data" / "synthetic_trace.jsonl"
    lines = trace.read_text().splitlines()
    assert len(lines) == 3993
    assert set(json.loads(lines[0])) >= {"timestamp", "input_length", "output_length", "hash_ids"}


@pytest.mark.parametrize("copy", sorted(COPIES), ids=lambda p: p.name)
def test_vendored_copy_equals_shared_original(copy: Path) -> None:
    original = SHARED / COPIES[copy]
    if not original.exists():
        pytest.skip(f"{original} is not beside this clone (a plain clone has none): nothing to compare")
    assert copy.read_bytes() == original.read_bytes(), f"{copy} differs from {original}"
