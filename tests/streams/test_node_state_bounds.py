"""A node's state stays the size of what the node has now, however long it runs.

The worker writes each node's whole state to its changelog (every checkpoint, and on every
finding): what the state keeps of pods and devices long gone is paid for on every write and
by every restore. These drive one node through months of churn as its inputs describe it
(dcgm-exporter pages parsed by the production collector, allocations as the watcher sends
them, MIG device UUIDs made anew by each repartitioning as NVML names them) and assert
what a platform engineer relies on: the state holds the live pods and devices only.
"""

from __future__ import annotations

import msgspec

from gpusteward.collectors import dcgm
from gpusteward.schema import DeviceSample, NodeInventory, NodeSample, PodAllocation, PodRef
from gpusteward.streams.node import NodeJoin, NodeState

T0 = 1_763_683_200.0
NODE = "l4-1"
GPU = "GPU-5a5a5a5a-0000-4000-8000-000000000000"
SERVER = PodRef(namespace="serve", name="embedder", uid="uid-embedder")
"""A pod sharing the time-sliced GPU all along."""


def _page(pods: list[PodRef]) -> str:
    """dcgm-exporter's page of a time-sliced L4: its series once per pod on it."""
    return "".join(
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{GPU}",modelName="NVIDIA L4",'
        f'Hostname="{NODE}",namespace="{pod.namespace}",pod="{pod.name}",container="c"}} 40\n'
        for pod in pods)


def _sample(pods: list[PodRef], ts: float) -> NodeSample:
    return dcgm.node_samples(dcgm.parse_page(_page(pods)), ts, "dcgm")[NODE]


def _allocation(pod: PodRef, phase: str, ts: float) -> PodAllocation:
    return PodAllocation(ts=ts, node=NODE, pod=pod, phase=phase,  # type: ignore[arg-type]
                         gpus=1, device_ids=[f"{GPU}::{pod.name[-1:]}"], started_at=ts,
                         workload_kind="notebook", owner_kind="Notebook", owner_name=pod.name)


def test_a_time_sliced_gpu_keeps_only_its_live_pods_after_a_thousand_came_and_went() -> None:
    join, state = NodeJoin(), NodeState()
    ts = T0
    join.on_allocation(state, _allocation(SERVER, "running", ts))
    for n in range(1000):
        pod = PodRef(namespace="nb", name=f"job-{n}", uid=f"uid-{n}")
        join.on_allocation(state, _allocation(pod, "running", ts))
        for _ in range(4):  # two minutes beside the server
            ts += 30
            join.on_sample(state, _sample([SERVER, pod], ts))
        join.on_allocation(state, _allocation(pod, "finished", ts + 1))
        # Its last sample read after its end: the samples travel on another topic.
        join.on_sample(state, _sample([SERVER, pod], ts + 0.5))
        ts += 1
    for _ in range(4):  # past the end's lateness window
        ts += 30
        join.on_sample(state, _sample([SERVER], ts))

    shares = state.devices[GPU].shares
    assert set(shares) == {"serve/embedder"}, f"{len(shares)} shares kept"
    assert list(state.pods) == ["uid-embedder"]
    assert len(msgspec.json.encode(state)) < 8_000


def test_a_pod_restarted_under_its_name_keeps_its_share() -> None:
    # A StatefulSet's pod comes back under its name (a new uid) before the old one's end is
    # read: dcgm-exporter names both the same, so the share is the new pod's.
    join, state = NodeJoin(), NodeState()
    old = PodRef(namespace="nb", name="web-0", uid="uid-old")
    new = PodRef(namespace="nb", name="web-0", uid="uid-new")
    join.on_allocation(state, _allocation(SERVER, "running", T0))
    join.on_allocation(state, _allocation(old, "running", T0))
    join.on_sample(state, _sample([SERVER, old], T0 + 30))
    join.on_allocation(state, _allocation(new, "running", T0 + 40))
    join.on_allocation(state, _allocation(old, "deleted", T0 + 45))
    for ts in (T0 + 60, T0 + 200):
        join.on_sample(state, _sample([SERVER, new], ts))
    assert set(state.devices[GPU].shares) == {"serve/embedder", "nb/web-0"}
    assert set(state.pods) == {"uid-embedder", "uid-new"}


MODEL = "NVIDIA A100-SXM4-80GB"


def _inventory(ts: float, mig_state: str, config: str) -> NodeInventory:
    return NodeInventory(ts=ts, node=NODE, gpu_product="NVIDIA-A100-SXM4-80GB", gpu_count=8,
                         mig_strategy="mixed", mig_config=config, mig_config_state=mig_state,
                         allocatable={"nvidia.com/mig-1g.10gb": 56})


def _mig_sample(ts: float, layout: int) -> NodeSample:
    """The NVML collector's sample of 8 A100s in 1g.10gb slices: a GPU instance made by a
    repartitioning has a UUID of its own."""
    return NodeSample(ts=ts, node=NODE, source="nvml", devices=[
        DeviceSample(uuid=f"MIG-{layout:04d}{gpu}{slot}-5a5a-4000-8000-000000000000",
                     index=gpu, model=MODEL, kind="mig", parent_uuid=f"GPU-{gpu}",
                     mig_profile="1g.10gb", gpu_instance_id=7 + slot, engine_active_pct=30.0,
                     ecc_dbe_volatile=0)
        for gpu in range(8) for slot in range(7)])


def test_a_node_repartitioned_daily_for_two_months_keeps_only_its_current_mig_devices() -> None:
    join, state = NodeJoin(), NodeState()
    ts = T0
    for day in range(60):
        config = ("all-1g.10gb", "all-balanced")[day % 2]
        join.on_allocation(state, _inventory(ts, "pending", config))
        join.on_allocation(state, _inventory(ts + 60, "success", config))
        for tick in range(1, 31):  # 15 min of the new layout, past mig_settle_s
            join.on_sample(state, _mig_sample(ts + 60 + 30 * tick, day))
        ts += 86_400

    current = {device.uuid for device in _mig_sample(ts, 59).devices}
    assert set(state.devices) == current, f"{len(state.devices)} devices kept"
    assert set(state.rollups.last_dbe) <= current
    assert len(msgspec.json.encode(state)) < 100_000


def test_a_mig_device_with_a_finding_open_is_kept_after_a_repartitioning() -> None:
    # What is open on a device of the old layout resolves as its rule says, not by oblivion:
    # here a notebook idle on a slice, whose end the worker has not read yet.
    join, state = NodeJoin(), NodeState()
    notebook = PodRef(namespace="nb", name="nb-0", uid="uid-nb")
    join.on_allocation(state, _inventory(T0, "success", "all-1g.10gb"))
    old = _mig_sample(T0, 0).devices[0]
    join.on_allocation(state, msgspec.structs.replace(
        _allocation(notebook, "running", T0), device_ids=[old.uuid], gpus=0,
        mig={"1g.10gb": 1}, started_at=T0 - 7200))
    idle = msgspec.structs.replace(old, engine_active_pct=0.0, pod=notebook)
    for tick in range(1, 121):  # an hour idle
        sample = _mig_sample(T0 + 30 * tick, 0)
        join.on_sample(state, msgspec.structs.replace(
            sample, devices=[idle, *sample.devices[1:]], ts=T0 + 30 * tick))
    assert state.devices[old.uuid].idle.open_id is not None
    ts = T0 + 3600
    join.on_allocation(state, _inventory(ts + 60, "pending", "all-balanced"))
    join.on_allocation(state, _inventory(ts + 120, "success", "all-balanced"))
    for tick in range(1, 31):
        join.on_sample(state, _mig_sample(ts + 120 + 30 * tick, 1))
    assert old.uuid in state.devices
    assert len(state.devices) == 57
