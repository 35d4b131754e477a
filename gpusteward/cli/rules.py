"""``gpusteward rules``: check a policy file, explain effective settings, list the rules.

Kept out of ``rules/`` so the rules stay free of the CLI framework and of
file reading; every command is a thin shell over the registry
(:mod:`gpusteward.rules`), :mod:`gpusteward.rules.policy` and the policy
loader the worker uses (:mod:`gpusteward.streams.policy_file`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gpusteward.rules import REGISTRY
from gpusteward.rules import policy as policies
from gpusteward.streams import policy_file

rules_app = typer.Typer(help="Rule policy: check, explain, list.", no_args_is_help=True)

PolicyOption = Annotated[
    Path | None,
    typer.Option("--policy", "-p", help="Policy file (default: $GPUSTEWARD_POLICY_FILE, else "
                 "the shipped defaults)."),
]


def _load(path: Path | None) -> policies.Policy:
    try:
        return (policy_file.load_policy(path) if path is not None
                else policy_file.policy_from_env())
    except policies.PolicyError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from error


@rules_app.command()
def check(file: Annotated[Path, typer.Argument(help="The policy file to check.")]) -> None:
    """Validate a policy file: exit 0 with a summary, or 1 with FILE:LINE: field: message."""
    try:
        loaded = policy_file.load_policy(file)
    except policies.PolicyError as error:
        for line in error.lines():
            typer.echo(line, err=True)
        raise typer.Exit(1) from error
    overrides = {section: len(getattr(loaded, section))
                 for section in ("node_pools", "queues", "namespaces")}
    typer.echo(f"{file}: OK: {len(loaded.rules)} rule section(s) of "
               f"{len(REGISTRY.configurable())} rules; "
               f"overrides for {overrides['node_pools']} node pool(s), {overrides['queues']} "
               f"queue(s), {overrides['namespaces']} namespace(s); node pool label "
               f"{loaded.node_pool_label}")


@rules_app.command()
def explain(
    namespace: Annotated[str | None, typer.Option(help="The pod's namespace.")] = None,
    queue: Annotated[str | None, typer.Option(help="The workload's queue.")] = None,
    node_pool: Annotated[str | None, typer.Option(help="The node's pool (value of the "
                                                  "policy's node_pool_label).")] = None,
    rule: Annotated[str | None, typer.Option(help="Only this rule.")] = None,
    output: Annotated[Literal["yaml", "table"], typer.Option(help="yaml or table.")] = "yaml",
    policy_file: PolicyOption = None,
) -> None:
    """The settings every rule applies for a namespace, queue and node pool."""
    effective = _load(policy_file).resolve(namespace, queue, node_pool).as_dict()
    if rule is not None:
        if rule not in effective:
            typer.echo(f"unknown rule {rule!r}; valid rules: {', '.join(sorted(effective))}",
                       err=True)
            raise typer.Exit(2)
        effective = {rule: effective[rule]}
    if output == "yaml":
        typer.echo(yaml.safe_dump(effective, sort_keys=False).rstrip())
        return
    table = Table("rule", "field", "value", title=f"namespace={namespace} queue={queue} "
                  f"node pool={node_pool}")
    for name, fields in effective.items():
        for field, value in fields.items():
            table.add_row(name, field, Text(_short(value)))  # Text: no markup in values
    Console().print(table)


@rules_app.command("list")
def list_rules() -> None:
    """Every registered rule: its scope, the finding kinds it emits, its fields."""
    console = Console()
    for name, rule in sorted(REGISTRY.items()):
        owner = "" if rule.owner == "worker" else f", run by {rule.owner}"
        # Values and descriptions are printed as they are: `[inference]` is a list, not markup.
        console.print(f"[bold]{escape(name)}[/] ({rule.scope}{owner}): "
                      f"{escape(rule.describe())}", highlight=False)
        console.print(f"  emits: {', '.join(rule.emits)}", highlight=False, markup=False)
        if rule.settings is None:
            continue
        defaults = rule.settings().model_dump(mode="json")
        for field, info in rule.settings.model_fields.items():
            console.print(f"  {field} = {_short(defaults[field])}: {info.description or ''}",
                          highlight=False, markup=False)


@rules_app.command()
def defaults() -> None:
    """Print the shipped policy file (every rule's defaults, documented)."""
    typer.echo(policies.render_defaults().rstrip())


def _short(value: Any) -> str:
    if isinstance(value, dict | list):
        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return str(value)
