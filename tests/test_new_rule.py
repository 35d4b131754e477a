"""A rule registered at test time reaches the node join, the policy and ``--enable-rule``.

The toy rules below are what a new rule is: one module (here, this file's top
half: settings, state, a sample hook) and one registry entry. Nothing else
in the tree names it, and yet the node join runs it (its state riding the
node's changelog encoding), a policy file configures it with located
errors, ``rules list`` shows it and enabling it lets the executor carry out
the actions of every kind it emits; the fleet agent runs a fleet-wide one.
The shared ``fresh_registry`` fixture takes them out again after each test.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict, Field
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.remediation.executor import Executor, RemediationSettings, known_rules
from gpusteward.rules import REGISTRY, Rule, UnknownRuleError
from gpusteward.rules.findings import action_for, finding_id, fingerprint
from gpusteward.rules.fragmentation import FleetView
from gpusteward.rules.policy import Policy, PolicyError, parse_policy
from gpusteward.rules.registry import DeviceRunner, FleetRunner, own_settings
from gpusteward.schema import (
    Action,
    ActionResult,
    DeviceSample,
    Finding,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    Subject,
)
from gpusteward.settings import Settings
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.node import NodeJoin, NodeState

KIND = "toy_hot"
PAGE_KIND = "toy_hot_page"


class ToySettings(BaseModel):
    """Settings of the toy rule: a GPU hot for a number of samples in a row."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(3, ge=1, description="Hot samples in a row that fire (count).")
    hot_c: float = Field(80.0, description="Temperature at or above which a sample is hot, °C.")


class ToyTrack(msgspec.Struct):
    hot_run: int = 0
    fired: bool = False


def observe(track: ToyTrack, node: str, device: DeviceSample, ts: float,
            settings: ToySettings, holder: object) -> list[Finding | Action]:
    hot = device.temp_c is not None and device.temp_c >= settings.hot_c
    track.hot_run = track.hot_run + 1 if hot else 0
    if track.fired or track.hot_run < settings.samples:
        return []
    track.fired = True
    fp = fingerprint(PAGE_KIND, node, device.uuid)
    finding = Finding(id=finding_id(fp, ts), fingerprint=fp, kind=PAGE_KIND,
                      severity="warning", state="firing", subject=Subject(node=node),
                      summary=f"{device.uuid} hot", starts_at=ts, ts=ts)
    return [finding, action_for(finding, "cordon", Subject(node=node), "toy")]


TOY = Rule(KIND, ToySettings, "device", kinds=(PAGE_KIND,), device=DeviceRunner(
    state="toy", state_type=ToyTrack, settings_from=own_settings(KIND), on_sample=observe))


def sample(ts: float, temp_c: float) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[DeviceSample(
        uuid="GPU-0", index=0, model="NVIDIA A100-SXM4-80GB", temp_c=temp_c, util_pct=90.0)])


def test_the_node_join_runs_a_registered_rule_and_keeps_its_state() -> None:
    REGISTRY.register(TOY)
    join, state = NodeJoin(policy=parse_policy("rules: {toy_hot: {samples: 2}}")), NodeState()
    assert join.on_sample(state, sample(1000.0, 85.0)) != []  # the first summary only
    # The state survives the changelog's encoding; the rule carries on where it was.
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=NodeState)
    out = join.on_sample(state, sample(1030.0, 90.0))
    fired = [o for o in out if isinstance(o, Finding | Action)]
    assert [(o.kind if isinstance(o, Finding) else o.rule) for o in fired] == [PAGE_KIND] * 2
    assert state.devices["GPU-0"].tracks["toy"] == ToyTrack(hot_run=2, fired=True)
    # Under the defaults (three samples), two hot samples are not enough.
    join, state = NodeJoin(), NodeState()
    for ts in (1000.0, 1030.0):
        assert not [o for o in join.on_sample(state, sample(ts, 90.0))
                    if isinstance(o, Finding)]


def test_the_policy_configures_it_with_located_errors() -> None:
    with pytest.raises(PolicyError, match="unknown rule; valid rules: "):
        parse_policy("rules: {toy_hot: {samples: 2}}")
    defaults = Policy()
    assert KIND not in defaults.resolve().rules
    REGISTRY.register(TOY)
    # A policy made before the rule was registered forgets its cached resolutions.
    assert defaults.resolve().of(KIND, ToySettings) == ToySettings()
    policy = parse_policy("rules:\n  toy_hot: {samples: 2}\nnode_pools:\n"
                          "  hot-room: {toy_hot: {hot_c: 70}}\n")
    assert policy.resolve().of(KIND, ToySettings) == ToySettings(samples=2)
    assert policy.resolve(node_pool="hot-room").of(KIND, ToySettings).hot_c == 70
    with pytest.raises(PolicyError) as caught:
        parse_policy("rules:\n  toy_hot:\n    samples: 0\n  toy_hot_page: {}\n", "toy.yaml")
    assert caught.value.lines() == [
        "toy.yaml:3: rules.toy_hot.samples: Input should be greater than or equal to 1",
        "toy.yaml:4: rules.toy_hot_page: a finding kind of rule toy_hot; configure it under "
        "toy_hot",
    ]


def test_enable_rule_accepts_it_and_enables_every_kind_it_emits() -> None:
    with pytest.raises(UnknownRuleError):
        known_rules(["toy_hot"])
    REGISTRY.register(TOY)
    assert known_rules(["toy_hot"]) == {"toy_hot"}
    enabled = RemediationSettings(enabled_rules={"toy_hot"})
    assert enabled.enables(PAGE_KIND) and not enabled.enables("ecc_dbe")

    class Cordoning:
        name = "test"

        async def cordon(self, action: Action) -> tuple[str, str]:
            return "executed", f"cordoned {action.target.node}"

    _, page = observe(ToyTrack(hot_run=5), "n1", sample(0, 99.0).devices[0], 10.0,
                      ToySettings(), None)
    assert isinstance(page, Action)

    async def decide(remediation: RemediationSettings) -> ActionResult:
        executor = Executor(Settings(), Cordoning(), execute=True, remediation=remediation,
                            clock=lambda: page.ts)  # the toy rule's event time
        return await executor.decide(page)

    assert asyncio.run(decide(enabled)).outcome == "executed"
    assert asyncio.run(decide(RemediationSettings(enabled_rules={"ecc_dbe"}))).outcome == \
        "dry_run"


def test_rules_list_shows_it() -> None:
    REGISTRY.register(TOY)
    result = CliRunner().invoke(app, ["rules", "list"])
    assert result.exit_code == 0, result.output
    assert "toy_hot (device): Settings of the toy rule" in result.output
    assert "emits: toy_hot, toy_hot_page" in result.output


def test_each_test_starts_from_the_shipped_rules() -> None:
    assert KIND not in REGISTRY and PAGE_KIND not in REGISTRY.kinds
    with REGISTRY.registered(TOY):
        assert REGISTRY.owner_of(PAGE_KIND) is TOY
    assert KIND not in REGISTRY


class EmptyFleetSettings(BaseModel):
    """Settings of the toy fleet rule: a fleet with no free GPU."""

    model_config = ConfigDict(extra="forbid")

    min_free_gpus: int = Field(1, ge=0, description="Free GPUs below which it fires (count).")


class EmptyFleetTrack(msgspec.Struct):
    evaluations: int = 0


def evaluate_empty(track: EmptyFleetTrack, fleet: FleetView, now: float,
                   settings: EmptyFleetSettings) -> list[Finding]:
    track.evaluations += 1
    free = sum(node.gpus_free for node in fleet.nodes)
    if free >= settings.min_free_gpus:
        return []
    fp = fingerprint("toy_full", "fleet")
    return [Finding(id=finding_id(fp, now), fingerprint=fp, kind="toy_full", severity="info",
                    state="firing", subject=Subject(), summary=f"{free} GPUs free",
                    starts_at=now, ts=now)]


def test_the_fleet_agent_runs_a_registered_fleet_rule() -> None:
    REGISTRY.register(Rule("toy_full", EmptyFleetSettings, "fleet", fleet=(
        FleetRunner("toy_full", EmptyFleetTrack, evaluate_empty),)))
    evaluator, state = FleetEvaluator(), FleetState()
    out = evaluator.on_summary(state, NodeSummary(ts=0.0, node="n1", gpu_model="H100",
                                                  gpus_total=8, gpus_free=0))
    assert [f.kind for f in out if isinstance(f, Finding)] == ["toy_full"]
    assert state.tracks["toy_full"] == EmptyFleetTrack(evaluations=1)


def test_a_join_that_already_ran_runs_a_rule_registered_after() -> None:
    # The join keeps what each holding's devices run between samples; a rule registered
    # since must reach a held device all the same.
    join, state = NodeJoin(), NodeState()
    pod = PodRef(namespace="ml-a", name="nb-a", uid="uid-a")
    join.on_allocation(state, PodAllocation(ts=990.0, node="n1", pod=pod, phase="running",
                                            gpus=1, device_ids=["GPU-0"], started_at=990.0))
    join.on_sample(state, sample(1000.0, 90.0))
    REGISTRY.register(TOY)
    out = [o for ts in (1030.0, 1060.0, 1090.0) for o in join.on_sample(state, sample(ts, 90.0))]
    assert [o.kind for o in out if isinstance(o, Finding)] == [PAGE_KIND]
    assert state.devices["GPU-0"].tracks["toy"] == ToyTrack(hot_run=3, fired=True)


def test_a_rule_watching_some_workload_kinds_runs_only_on_their_devices() -> None:
    # A runner's ``watches`` says, per holder's workload kind, whether it has anything to
    # do there (the low-free memory rule watches serving pods): the join never calls it on
    # the others' devices nor on unheld ones, and a new holder of a watched kind gets it.
    called: list[str] = []

    def counting(track: ToyTrack, node: str, device: DeviceSample, ts: float,
                 settings: ToySettings, holder: object) -> list[Finding | Action]:
        called.append(device.uuid)
        return []

    REGISTRY.register(Rule(KIND, ToySettings, "device", device=DeviceRunner(
        state="toy", state_type=ToyTrack, settings_from=own_settings(KIND),
        on_sample=counting, watches=lambda settings, kind: kind == "inference")))
    join, state = NodeJoin(), NodeState()

    def hold(ts: float, name: str, kind: str, device: str) -> None:
        join.on_allocation(state, PodAllocation(
            ts=ts, node="n1", pod=PodRef(namespace="ml", name=name, uid=name), phase="running",
            gpus=1, device_ids=[device], started_at=ts, workload_kind=kind))

    def three_gpus(ts: float) -> NodeSample:
        return NodeSample(ts=ts, node="n1", source="test", devices=[
            DeviceSample(uuid=f"GPU-{i}", index=i, model="NVIDIA A100-SXM4-80GB",
                         util_pct=50.0) for i in range(3)])

    hold(990.0, "server", "inference", "GPU-0")
    hold(990.0, "nb", "notebook", "GPU-1")  # GPU-2: held by no one
    join.on_sample(state, three_gpus(1000.0))
    assert called == ["GPU-0"]
    join.on_allocation(state, PodAllocation(ts=1001.0, node="n1", phase="deleted",
                                            pod=PodRef(namespace="ml", name="nb", uid="nb")))
    hold(1002.0, "server-2", "inference", "GPU-1")
    join.on_sample(state, three_gpus(1010.0))
    assert called == ["GPU-0", "GPU-0", "GPU-1"]
