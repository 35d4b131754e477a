"""README.md and docs/ stay true: every relative link reaches a file, every anchor a heading.

The pages move often (the README is the front door, the detail lives in
docs/); a link that a move broke fails here. Facts in the pages are kept true
by the tests of the things they describe (docs/topics.md is generated and
compared, the architecture by tests/test_architecture.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RULES = ROOT / "deploy" / "components" / "monitoring" / "prometheusrule.yaml"
DASHBOARDS = sorted((ROOT / "deploy" / "base" / "dashboards").glob("*.json"))
# gpusteward's own alerts (GpuSteward<Kind>, the findings', are spelt otherwise).
ALERT = re.compile(r"\bGpusteward(?!Error\b)[A-Z]\w+")
# Alerts renamed, old name to new: the upgrade notes (docs/deploy.md) may name the old one.
RENAMED = {"GpustewardConsumerLagGrowing": "GpustewardConsumerBehind"}


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def broken_links(pages: list[Path]) -> list[str]:
    return broken_links_in(ROOT, pages)


def broken_links_in(root: Path, pages: list[Path]) -> list[str]:
    bad = []
    for page in pages:
        text = re.sub(r"(?s)```.*?```", "", page.read_text())
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                bad.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_link_in_readme_and_docs_resolves() -> None:
    assert broken_links(PAGES) == []


def test_readme_keeps_the_two_commands_and_one_benchmark_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert readme.count("| area | figure | value |") == 1
    for page in PAGES[1:]:
        assert "| area | figure | value |" not in page.read_text(), page.name


def test_control_a_broken_link_and_anchor_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text("# Title, here\n\n[ok](#title-here) [ok](b.md#b) [x](c.md) [y](#nope)\n"
                    "[z](b.md#none) [web](https://example.org)\n")
    (tmp_path / "b.md").write_text("# B\n")
    problems = [line.split(": ", 1)[1] for line in broken_links_in(tmp_path, [page])]
    assert problems == ["c.md (no such file)", "#nope (no such heading)",
                        "b.md#none (no such heading)"]


def test_every_alert_the_pages_and_dashboards_name_is_one_the_rules_define() -> None:
    """A renamed alert left in a page or a dashboard sends an operator looking for an
    alert that never fires (the lag alert was renamed GpustewardConsumerBehind)."""
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert set(RENAMED.values()) <= alerts and not set(RENAMED) & alerts
    for page in [*PAGES, *DASHBOARDS]:
        named = set(ALERT.findall(page.read_text()))
        known = alerts | set(RENAMED) if page.name == "deploy.md" else alerts
        assert named <= known, f"{page.name}: {sorted(named - known)}"


def _commands() -> dict[str, Any]:
    import typer

    from gpusteward.cli import app

    commands: dict[str, Any] = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return commands


def test_the_processes_page_lists_every_command() -> None:
    """docs/processes.md's table is where a user looks for what the CLI can run."""
    table = [line for line in (ROOT / "docs" / "processes.md").read_text().splitlines()
             if line.startswith("| `gpusteward ")]
    listed = {word for row in table for cell in row.split("|")[1:2]
              for word in re.findall(r"`gpusteward ([a-z-]+)", cell)}
    assert sorted(set(_commands()) - listed) == []


def _documented(variable: str, prefix: str, text: str) -> bool:
    """Named in full, or by its name under the prefix in backticks (`INTERVAL_S` in a table
    of GPUSTEWARD_COLLECT__ settings)."""
    short = variable.removeprefix(prefix)
    return bool(re.search(rf"\b{variable}\b", text)) or f"`{short}`" in text


def test_every_setting_has_a_documented_variable() -> None:
    """A setting whose variable no page names is one a user cannot find without reading the
    code; the variables the pages name are read by some process
    (tests/deploy/test_environment.py)."""
    from tests.deploy.reads import READS, Model, model_names

    text = "\n".join(page.read_text() for page in PAGES)
    models = {read.settings for reads in READS.values() for read in reads
              if isinstance(read, Model)}
    missing = []
    for settings in sorted(models, key=lambda m: m.__name__):
        names = model_names(Model(settings))
        prefix = str(settings.model_config.get("env_prefix", "")).upper()
        groups = {n for n in names.exact if any(o.startswith(f"{n}__") for o in names.exact)}
        missing += [f"{settings.__name__}: {name}" for name in sorted(names.exact - groups)
                    if not _documented(name, prefix, text)]
    assert missing == [], "\n".join(missing)


def unknown_flags(text: str) -> list[str]:
    """`gpusteward CMD ... --flag` written in ``text`` (in backticks or at a line's start
    in a code block) whose command has no such option."""
    commands = _commands()
    problems = []
    for line in (re.findall(r"`(gpusteward [^`]*)`", text)
                 + re.findall(r"^\s*(gpusteward [^#\n]*)", text, re.M)):
        words = line.split()[1:]
        command: Any = None
        group = commands
        while words and words[0] in group:
            command = group[words.pop(0)]
            group = getattr(command, "commands", {})
        if command is None or getattr(command, "commands", None):
            continue
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        problems += [f"{line}: {flag}" for word in words
                     for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", word)
                     if flag not in options]
    return problems


def test_every_flag_the_pages_give_a_command_is_one_it_has() -> None:
    assert [p for page in PAGES for p in unknown_flags(page.read_text())] == []
    assert unknown_flags("run `gpusteward doctor --skip kafka --skp kube` or\n"
                         "    gpusteward collect nvml --node a --nodes b   # x\n") == [
        "gpusteward doctor --skip kafka --skp kube: --skp",
        "gpusteward collect nvml --node a --nodes b   : --nodes"]
