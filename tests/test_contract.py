"""The public contract: JSON Schema export, the topic page, and wire round trips."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from typer.testing import CliRunner

from gpusteward import topics
from gpusteward.cli import app
from gpusteward.schema import DeviceHolder, DeviceSample, NodeSample, PodRef
from gpusteward.settings import Settings
from gpusteward.topicdoc import render

ROOT = Path(__file__).resolve().parents[1]


def test_schema_export_writes_one_valid_schema_per_topic(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["schema", "export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in tmp_path.glob("*.schema.json"))
    assert files == sorted(f"{s.name(Settings())}.schema.json" for s in topics.ALL)
    samples = json.loads((tmp_path / "gpusteward.samples.v1.schema.json").read_text())
    node_sample = samples["$defs"]["NodeSample"]
    assert {"ts", "node", "source", "devices"} <= set(node_sample["required"])


def test_committed_topic_page_is_current() -> None:
    committed = (ROOT / "docs" / "topics.md").read_text()
    assert committed == render(), "run `gpusteward schema docs` and commit docs/topics.md"


def test_unknown_fields_are_tolerated_missing_required_ones_are_not() -> None:
    """Downstream readers of an older version keep working when fields are added."""
    sample = NodeSample(ts=1.0, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=3.0,
                     pod=PodRef(namespace="a", name="b"))])
    wire = json.loads(msgspec.json.encode(sample))
    assert wire["schema"] == 1 and "temp_c" not in wire["devices"][0]  # absent = not reported
    wire["future_field"] = {"x": 1}
    assert msgspec.json.decode(json.dumps(wire), type=NodeSample) == sample
    del wire["node"]
    try:
        msgspec.json.decode(json.dumps(wire), type=NodeSample)
    except msgspec.ValidationError as error:
        assert "node" in str(error)
    else:
        raise AssertionError("a sample without a node must not decode")


def test_node_keyed_topics_are_co_partitioned() -> None:
    settings = Settings()
    counts = {s.partition_count(settings) for s in (topics.SAMPLES, topics.HW_EVENTS,
                                                   topics.ALLOCATIONS)}
    assert counts == {settings.kafka.node_partitions}


def test_pod_keys_are_partitioned_with_their_node() -> None:
    from gpusteward.kafka import node_partitioner
    from gpusteward.schema import NodeInventory, PodAllocation

    partitions = list(range(8))
    nodes = [f"gpu-node-{i}" for i in range(50)]
    for node in nodes:
        pod = PodAllocation(ts=1, node=node, pod=PodRef(namespace="ns", name="p", uid="u1"),
                            phase="running")
        key = topics.allocation_key(pod)
        assert key == f"{node}/pod/u1"
        assert topics.allocation_key(NodeInventory(ts=1, node=node)) == node
        assert (node_partitioner(key.encode(), partitions, partitions)
                == node_partitioner(node.encode(), partitions, partitions))
    spread = {node_partitioner(n.encode(), partitions, partitions) for n in nodes}
    assert len(spread) > 4, "nodes still spread over the partitions"
    assert topics.ALLOCATIONS.config() == {"cleanup.policy": "compact",
                                           "segment.ms": "600000", "segment.bytes": "67108864"}


class OldDevice(msgspec.Struct):
    """A device as schema 1 read it before holders were added."""

    uuid: str
    index: int
    model: str
    util_pct: float | None = None
    pod: PodRef | None = None


class OldSample(msgspec.Struct):
    ts: float
    node: str
    source: str
    devices: list[OldDevice]
    schema: int = 1


def test_a_shared_device_reads_the_same_to_a_consumer_of_the_single_pod() -> None:
    """Holders are additive: a reader that knows only ``pod`` (the schema before holders)
    decodes a shared device's sample and finds the first named holder there."""

    busy = PodRef(namespace="nb", name="busy", uid="u1")
    sample = NodeSample(ts=1.0, node="n1", source="nvml", devices=[DeviceSample(
        uuid="GPU-1", index=0, model="H100", util_pct=80.0, pod=busy, attribution="process",
        holders=[DeviceHolder(pod=busy, activity_pct=80.0, mem_used_bytes=10),
                 DeviceHolder(pod_uid="u2", activity_pct=0.0, mem_used_bytes=4)])])
    wire = msgspec.json.encode(sample)
    assert sample.schema == 1  # additive: no version bump
    (old,) = msgspec.json.decode(wire, type=OldSample).devices
    assert (old.pod, old.util_pct) == (busy, 80.0)
    assert msgspec.json.decode(wire, type=NodeSample) == sample
