"""YAML configuration files whose errors say ``FILE:LINE: field: message``.

The policy file and the simulated world's files (scenarios, fake-NVML descriptions)
are YAML that a person writes by hand, and a mistake in one must point at the
line to fix. So the text is composed into YAML nodes, which keep their position,
as well as loaded into plain data; the data is checked (by a pydantic model, or
by hand), and each problem's location (a pydantic ``loc`` such as
``("rules", "idle_holder", "window_s")``) is walked down the node tree to the
line that holds it. Each file kind has its own :class:`ConfigFileError`
subclass, so callers catch what they load; the locating code lives here once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpusteward.errors import ConfigError


@dataclass(frozen=True)
class Issue:
    """One problem in a configuration file, located."""

    line: int | None
    """1-based line; None when the problem has no place in the text (the file is unreadable)."""
    field: str
    """Dotted path of the field (``rules.idle_holder.window_s``); empty for the whole file."""
    message: str


class ConfigFileError(ConfigError, ValueError):
    """A configuration file that cannot be used; ``issues`` locates every problem found."""

    def __init__(self, origin: str, issues: list[Issue]) -> None:
        self.origin = origin
        self.issues = issues
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """``FILE:LINE: field: message`` for every issue."""
        return [f"{self.origin}:{i.line if i.line is not None else '?'}: {i.field or '<top>'}: "
                f"{i.message}" for i in self.issues]


def read_text(path: str | os.PathLike[str],
              error: type[ConfigFileError] = ConfigFileError) -> str:
    """The UTF-8 text of ``path``; ``error`` when it cannot be read or is not UTF-8 (the
    line of the first byte that is not)."""
    origin = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as cause:
        raise error(origin, [Issue(None, "", f"cannot read: {cause}")]) from cause
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as cause:
        line = data.count(b"\n", 0, cause.start) + 1
        raise error(origin, [Issue(line, "", f"not UTF-8 text: {cause.reason} "
                                             f"(byte {data[cause.start]:#04x})")]) from cause


def compose(text: str, origin: str,
            error: type[ConfigFileError] = ConfigFileError) -> tuple[yaml.Node | None, Any]:
    """The YAML node tree of ``text`` (for :func:`line_of`) and its plain data; ``error``
    with the line when the text is not YAML. An empty document is ``(None, None)``."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as cause:
        mark = cause.problem_mark
        raise error(origin, [Issue(mark.line + 1 if mark else None, "",
                                   f"not valid YAML: {cause.problem}")]) from cause
    except yaml.reader.ReaderError as cause:  # a character YAML does not allow (a NUL)
        line = text.count("\n", 0, cause.position) + 1
        raise error(origin, [Issue(line, "", f"not valid YAML: {cause.reason} "
                                             f"(character #x{cause.character:04x})")]) from cause
    return root, data


def duplicate_keys(root: yaml.Node | None) -> list[Issue]:
    """Keys given twice in one mapping, at the line of each repeat: YAML keeps the last one
    silently, so a field given twice by mistake would go unnoticed. Keys compare as YAML
    reads them (``13`` and ``+13`` are one); merge keys (``<<``) and aliases are not
    repeats."""
    constructor = yaml.constructor.SafeConstructor()
    issues: list[Issue] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if id(node) in seen:  # an alias: its node was walked where the anchor is
            return
        seen.add(id(node))
        children: list[tuple[str, yaml.Node]] = []
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, value_node in node.value:
                children.append((str(key_node.value), value_node))
                if not isinstance(key_node, yaml.ScalarNode) or \
                        key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = constructor.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    issues.append(Issue(line, ".".join((*path, str(key_node.value))),
                                        f"duplicate key, first given on line "
                                        f"{first_line[key]}"))
                else:
                    first_line[key] = line
        elif isinstance(node, yaml.SequenceNode):
            children = [(str(i), item) for i, item in enumerate(node.value)]
        for name, child in children:
            walk(child, (*path, name))

    if root is not None:
        walk(root, ())
    return issues


def _key_node(node: yaml.Node, key: Any) -> tuple[yaml.Node | None, yaml.Node | None]:
    """The key node and value node of ``key`` in a mapping node."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if str(key_node.value) == str(key):
                return key_node, value_node
    return None, None


def line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the deepest node ``loc`` reaches in the composed YAML."""
    if root is None:
        return None
    node: yaml.Node = root
    line = node.start_mark.line + 1
    for part in loc:
        if part == "[key]":
            return line
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            continue
        key_node, value_node = _key_node(node, part)
        if key_node is None or value_node is None:
            return line
        line = key_node.start_mark.line + 1
        node = value_node
    return line


def issues_of(error: ValidationError, root: yaml.Node | None,
              prefix: tuple[Any, ...] = ()) -> list[Issue]:
    """Every error of a pydantic validation of the data under ``prefix``, located in
    ``root``."""
    out = []
    for detail in error.errors():
        loc = prefix + tuple(detail["loc"])
        name = ".".join(str(p) for p in loc if p != "[key]")
        # A model's own check (a pattern, a shape) says what is wrong in full.
        out.append(Issue(line_of(root, loc), name, detail["msg"].removeprefix("Value error, ")))
    return out
