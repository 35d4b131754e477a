"""The import direction of docs/architecture.md, checked on every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "rules": ("gpusteward.streams", "gpusteward.collectors", "gpusteward.consumers",
              "faust", "aiokafka", "kubernetes", "gpusteward.kafka"),
    "streams": ("gpusteward.collectors", "gpusteward.consumers"),
    "collectors": ("gpusteward.streams", "gpusteward.rules"),
}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offending(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_rules_are_pure() -> None:
    assert offending("rules") == []


def test_streams_do_not_reach_into_collectors() -> None:
    assert offending("streams") == []


def test_collectors_only_publish_the_contract() -> None:
    assert offending("collectors") == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from gpusteward.streams import app\nimport faust\n")
    assert {"gpusteward.streams", "faust"} <= imports(module)
