"""The layers of docs/architecture.md, checked on every module of every room.

Each room is a folder mapped into the one import package. A module may import
only the rooms its layer allows (below it, or beside it where the table says
so); the sandbox (the simulated world) is imported only by the CLI's demo
commands, the tests and the benchmarks; one module writes to the Kubernetes
API; and no two modules import each other, directly or round a circle.
Imports inside functions count the same as those at the top.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROOMS = {  # folder -> module prefix (pyproject's package-dir)
    "gpusteward": "gpusteward",
    "collectors": "gpusteward.collectors",
    "streams": "gpusteward.streams",
    "rules": "gpusteward.rules",
    "alerting": "gpusteward.alerting",
    "remediation": "gpusteward.remediation",
    "reports": "gpusteward.reports",
    "sandbox": "gpusteward.sandbox",
}
CORE = "core"
CLI = "gpusteward.cli"

ALLOWED: dict[str, set[str]] = {
    # the contract and plumbing: schema, topics, settings, Kafka, broker, errors
    CORE: {CORE},
    "gpusteward.rules": {CORE, "gpusteward.rules"},
    "gpusteward.collectors": {CORE, "gpusteward.collectors"},
    "gpusteward.streams": {CORE, "gpusteward.rules", "gpusteward.streams"},
    "gpusteward.alerting": {CORE, "gpusteward.rules", "gpusteward.alerting"},
    "gpusteward.remediation": {CORE, "gpusteward.rules", "gpusteward.remediation"},
    "gpusteward.reports": {CORE, "gpusteward.rules", "gpusteward.reports"},
    "gpusteward.sandbox": {CORE, "gpusteward.rules", "gpusteward.collectors",
                           "gpusteward.streams", "gpusteward.alerting",
                           "gpusteward.remediation", "gpusteward.reports",
                           "gpusteward.sandbox"},
    CLI: {CORE, "gpusteward.rules", "gpusteward.collectors", "gpusteward.streams",
          "gpusteward.alerting", "gpusteward.remediation", "gpusteward.reports", CLI},
}
SANDBOX_IMPORTERS = {"gpusteward.cli.sandbox", "gpusteward.cli.collect"}
"""The CLI's commands for the simulated world (demo, simulate, replay), and
``collect nvml``, which samples the sandbox's fake NVML when told to."""

PURE_FORBIDDEN = ("faust", "aiokafka", "kubernetes", "aiohttp", "grpc", "polars", "socket")
"""Rules do no I/O: no clients, no sockets, no data frames."""

KUBE_CLIENT_USERS = {"gpusteward.collectors.kubernetes.watcher",
                     "gpusteward.remediation.kubernetes", "gpusteward.cli.watch",
                     "gpusteward.cli.doctor"}
"""``cli.doctor`` only reads and asks access reviews (which store nothing)."""
KUBE_WRITER = "gpusteward.remediation.kubernetes"
WRITE_METHOD = re.compile(r"^(create|patch|replace|delete)_(namespaced_\w+|node\w*|cluster_\w+|"
                          r"collection_\w+)$")
"""The official client's write methods (``patch_node``, ``create_namespaced_event``, ...)."""


def modules(root: Path = ROOT, rooms: dict[str, str] = ROOMS) -> Iterator[tuple[str, Path]]:
    for folder, prefix in rooms.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([prefix, *parts]), path


def imports(path: Path, module: str) -> set[str]:
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            # `from gpusteward.x import y` may name a module y: count it too
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def layer(module: str) -> str:
    for name in ALLOWED:
        if name != CORE and (module == name or module.startswith(name + ".")):
            return name
    return CORE


def upward_imports(root: Path = ROOT, rooms: dict[str, str] = ROOMS) -> list[str]:
    known = {name for name, _ in modules(root, rooms)}
    bad = []
    for module, path in modules(root, rooms):
        own = layer(module)
        for name in sorted(imports(path, module)):
            if name not in known:
                continue
            target = layer(name)
            if target == "gpusteward.sandbox" and own != target:
                if module not in SANDBOX_IMPORTERS:
                    bad.append(f"{module} imports the sandbox ({name})")
                continue
            if target not in ALLOWED[own]:
                bad.append(f"{module} ({own}) imports {name} ({target})")
    return bad


def graph(root: Path = ROOT, rooms: dict[str, str] = ROOMS) -> dict[str, set[str]]:
    known = {name for name, _ in modules(root, rooms)}
    edges: dict[str, set[str]] = {}
    for module, path in modules(root, rooms):
        # a package's own __init__ is where its submodules are found, not a dependency
        edges[module] = {name for name in imports(path, module)
                         if name in known and name != module
                         and not module.startswith(name + ".")}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def third_party(module: str, path: Path, prefixes: Iterable[str]) -> list[str]:
    return sorted(name for name in imports(path, module)
                  if any(name == p or name.startswith(p + ".") for p in prefixes))


def kube_writes(path: Path) -> list[str]:
    """Uses of the Kubernetes client's write methods, called or passed on."""
    return [node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and WRITE_METHOD.match(node.attr)]


def test_no_room_imports_upward_or_the_sandbox() -> None:
    assert upward_imports() == []


def test_no_import_circles() -> None:
    assert circles(graph()) == []


def test_rules_are_pure() -> None:
    bad = {module: third_party(module, path, PURE_FORBIDDEN)
           for module, path in modules() if layer(module) == "gpusteward.rules"}
    assert {m: names for m, names in bad.items() if names} == {}


def test_only_the_watcher_and_the_remediation_backend_use_the_kubernetes_client() -> None:
    users = {module for module, path in modules() if third_party(module, path, ["kubernetes"])}
    assert users <= KUBE_CLIENT_USERS


def test_one_module_writes_to_the_kubernetes_api() -> None:
    writers = {module for module, path in modules()
               if module in KUBE_CLIENT_USERS and kube_writes(path)}
    assert writers == {KUBE_WRITER}


# Control tests: the checks above see what they are meant to catch.

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, str]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"gpusteward": "gpusteward", "rules": "gpusteward.rules",
            "streams": "gpusteward.streams", "sandbox": "gpusteward.sandbox"}


def test_control_an_upward_import_is_caught(tmp_path: Path) -> None:
    rooms = _tree(tmp_path, {
        "gpusteward/schema.py": "",
        "rules/idle.py": "from gpusteward.streams import app\nfrom gpusteward import schema\n",
        "streams/app.py": "from gpusteward.rules import idle\nfrom ..sandbox import world\n",
        "sandbox/world.py": "",
    })
    assert upward_imports(tmp_path, rooms) == [
        "gpusteward.rules.idle (gpusteward.rules) imports gpusteward.streams.app "
        "(gpusteward.streams)",
        "gpusteward.streams.app imports the sandbox (gpusteward.sandbox.world)",
    ]


def test_control_a_circle_is_caught(tmp_path: Path) -> None:
    rooms = _tree(tmp_path, {
        "streams/a.py": "from gpusteward.streams import b\n",
        "streams/b.py": "def f():\n    from gpusteward.streams.c import x\n",
        "streams/c.py": "from .a import y\n",
        "streams/d.py": "from gpusteward.streams import a\n",
    })
    assert circles(graph(tmp_path, rooms)) == [
        ["gpusteward.streams.a", "gpusteward.streams.b", "gpusteward.streams.c"]]


def test_control_a_kubernetes_write_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(api):\n    api.patch_node('n', {})\n"
                      "    api.create_namespaced_pod_eviction('p', 'ns', {})\n"
                      "    api.list_node()\n    asyncio.create_task(f)\n"
                      "    call(api.delete_namespaced_pod, 'p')\n")
    assert sorted(kube_writes(module)) == ["create_namespaced_pod_eviction",
                                          "delete_namespaced_pod", "patch_node"]
