"""The NVML collector on the fake NVML: readings, MIG, absent values, events, lost GPUs."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest

from gpusteward.collectors.nvml import NvmlCollector, NvmlUnavailable
from gpusteward.collectors.nvml.reader import profile_name
from gpusteward.sandbox.nvml_fake import FakeNvml

GIB = 1 << 30


def _collector(nvml, publisher, **kwargs) -> NvmlCollector:
    kwargs.setdefault("interval_s", 60.0)  # the tests drive ticks themselves
    kwargs.setdefault("event_wait_ms", 50)
    return NvmlCollector(nvml, "node-a", publisher, **kwargs)


async def _ticks(collector: NvmlCollector, n: int):
    collector.open()
    try:
        return [await collector.tick() for _ in range(n)]
    finally:
        collector.close()


def _metric(collector: NvmlCollector, name: str, **labels: str) -> float:
    value = collector.metrics.registry.get_sample_value(name, {"source": "nvml", **labels})
    return 0.0 if value is None else value


def test_mig_node_reports_every_mig_device_with_profile_name_and_parent(fake_nvml, publisher):
    collector = _collector(fake_nvml("mig-node"), publisher)
    first, second = asyncio.run(_ticks(collector, 2))

    assert [s.node for s in publisher.samples] == ["node-a", "node-a"]
    assert first.source == "nvml"
    gpus = [d for d in second.devices if d.kind == "gpu"]
    migs = {d.uuid: d for d in second.devices if d.kind == "mig"}
    assert len(gpus) == 3 and len(migs) == 5
    h100 = gpus[0]
    a = migs["MIG-0a1b2c3d-0000-4000-8000-000000000001"]
    assert (a.parent_uuid, a.index) == (h100.uuid, 0)
    assert (a.mig_profile, a.gpu_instance_id) == ("3g.40gb", 1)
    assert a.model == "NVIDIA H100 80GB HBM3"
    assert a.mem_total_bytes == int(39.5 * GIB) and a.mem_used_bytes == 20 * GIB
    assert {d.mig_profile for d in migs.values()} == {"3g.40gb", "2g.20gb", "1g.10gb", "7g.80gb"}
    assert migs["MIG-0a1b2c3d-0000-4000-8000-000000000011"].gpu_instance_id == 0
    # NVML has no utilisation for MIG devices; engine activity comes from GPM, which needs
    # two samples: absent on the first tick.
    assert all(d.util_pct is None for d in migs.values())
    assert [d.engine_active_pct for d in first.devices if d.kind == "mig"] == [None] * 5
    assert a.engine_active_pct == 62.5
    assert migs["MIG-0a1b2c3d-0000-4000-8000-000000000002"].engine_active_pct == 0.0
    # The A100 has no GPM: activity is absent, not zero.
    assert migs["MIG-0a1b2c3d-0000-4000-8000-000000000021"].engine_active_pct is None
    # MIG-enabled GPUs: no utilisation, no remapped rows (NVML says NotSupported), still temp.
    assert all(g.util_pct is None and g.remapped_rows_correctable is None for g in gpus)
    assert h100.temp_c == 44.0 and h100.power_w == 310.0
    assert _metric(collector, "gpusteward_collect_source_errors_total",
                   reason="nvmlDeviceGetUtilizationRates") == 0


def test_mixed_node_reads_every_field_in_schema_units(fake_nvml, publisher):
    collector = _collector(fake_nvml("mixed-node"), publisher)
    (sample,) = asyncio.run(_ticks(collector, 1))

    whole, parent, *migs = sample.devices
    assert (whole.kind, parent.kind) == ("gpu", "gpu")
    assert [m.kind for m in migs] == ["mig", "mig"]
    assert [m.gpu_instance_id for m in migs] == [1, 2]
    assert all(m.mig_profile == "3g.40gb" and m.parent_uuid == parent.uuid for m in migs)
    assert whole.uuid == "GPU-11111111-2222-4333-8444-555555555555" and whole.index == 0
    assert whole.util_pct == 87.0
    assert whole.mem_total_bytes == 80 * GIB
    assert whole.mem_used_bytes == 61 * GIB  # memory v2: used excludes the reserved 0.5 GiB
    assert whole.temp_c == 61.0
    assert whole.power_w == pytest.approx(512.345)  # NVML reports milliwatts
    assert whole.sm_clock_mhz == 1755
    assert whole.clock_event_reasons == pynvml.nvmlClocksEventReasonSwPowerCap
    assert (whole.ecc_sbe_volatile, whole.ecc_dbe_volatile) == (3, 0)
    assert (whole.remapped_rows_correctable, whole.remapped_rows_uncorrectable) == (2, 0)
    assert (whole.remap_pending, whole.remap_failure) == (False, False)
    assert whole.pcie_replay == 1
    assert whole.nvlink_errors == 2  # replay + recovery totals
    assert whole.nvlink_crc_errors == 5  # CRC flit + CRC data totals
    assert whole.recovery_action == 0
    assert whole.pod is None  # no PodResources client: nothing attributed
    assert parent.util_pct is None and parent.temp_c == 39.0
    assert parent.nvlink_errors is None  # no NVLink described: fields NotSupported
    assert _metric(collector, "gpusteward_collect_samples_total") == 1
    assert _metric(collector, "gpusteward_collect_device_readings_total") == 4


def test_not_supported_readings_are_absent_not_errors(fake_nvml, publisher):
    fake = fake_nvml("not-supported")
    collector = _collector(fake, publisher)
    (sample,) = asyncio.run(_ticks(collector, 1))

    (t4,) = sample.devices
    assert t4.model == "Tesla T4" and t4.kind == "gpu"
    assert t4.util_pct == 12.0 and t4.temp_c == 50.0 and t4.mem_used_bytes == GIB
    for absent in ("power_w", "sm_clock_mhz", "clock_event_reasons", "ecc_sbe_volatile",
                   "ecc_dbe_volatile", "remapped_rows_correctable", "remapped_rows_uncorrectable",
                   "remap_pending", "remap_failure", "pcie_replay", "nvlink_errors",
                   "recovery_action", "engine_active_pct"):
        assert getattr(t4, absent) is None, absent
    # Absent fields are left out of the JSON payload entirely.
    assert "power_w" not in __import__("msgspec").json.encode(t4).decode()
    errors = [s for m in collector.metrics.registry.collect()
              if m.name == "gpusteward_collect_source_errors"
              for s in m.samples if s.value]
    assert errors == []


def test_old_driver_without_new_symbols_falls_back(fake_nvml, publisher):
    fake = fake_nvml("mixed-node")
    missing = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    real_memory = fake.nvmlDeviceGetMemoryInfo

    def memory_v1_only(handle, version=None):
        if version:
            raise missing
        return real_memory(handle)

    def no_temperature_v(handle, sensor):
        raise missing

    fake.nvmlDeviceGetMemoryInfo = memory_v1_only
    fake.nvmlDeviceGetTemperatureV = no_temperature_v
    (sample,) = asyncio.run(_ticks(_collector(fake, publisher), 1))
    whole = sample.devices[0]
    assert whole.temp_c == 61.0
    assert whole.mem_used_bytes == int(61.5 * GIB)  # v1: used includes reserved memory


def test_xid_79_mid_run_is_published_at_once_and_the_gpu_is_lost(fake_nvml, publisher):
    fake = fake_nvml("faults")

    collector = _collector(fake, publisher, interval_s=30.0)  # the test ticks by hand

    async def scenario() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(collector.run(stop))
        await publisher.wait_for(lambda p: len(p.samples) == 1)
        await asyncio.sleep(0.1)  # let the listener register
        started = time.monotonic()
        fake.step()  # Xid 79 on GPU 2, which falls off the bus
        await publisher.wait_for(lambda p: bool(p.events_of("xid") and p.events_of("gpu_lost")))
        latency = time.monotonic() - started
        await collector.tick()  # the tick finds the GPU gone too: no second gpu_lost
        stop.set()
        await asyncio.wait_for(task, 5)
        return latency

    latency = asyncio.run(scenario())
    (xid,) = publisher.events_of("xid")
    assert (xid.xid, xid.uuid, xid.node, xid.source) == (
        79, "GPU-a2a2a2a2-0000-4000-8000-000000000002", "node-a", "nvml")
    (lost,) = publisher.events_of("gpu_lost")
    assert lost.uuid == xid.uuid
    assert latency < 3.0  # from the event, not from the next tick 30 s later
    first, second = publisher.samples
    assert len(first.devices) == 3
    assert [d.index for d in second.devices] == [0, 1]  # the others are still sampled


def test_a_lost_gpu_is_reported_once_and_the_others_are_still_sampled(fake_nvml, publisher):
    fake = fake_nvml("faults")
    collector = _collector(fake, publisher)

    async def scenario():
        collector.open()
        before = await collector.tick()
        fake.gpu(2).lost = True  # falls off the bus without an event reaching a listener
        during = [await collector.tick(), await collector.tick()]
        fake.gpu(2).lost = False
        after = await collector.tick()
        collector.close()
        return before, during, after

    before, during, after = asyncio.run(scenario())
    lost_uuid = "GPU-a2a2a2a2-0000-4000-8000-000000000002"
    assert len(before.devices) == 3
    for sample in during:
        assert [d.index for d in sample.devices] == [0, 1]
        assert all(d.util_pct is not None for d in sample.devices)
    (lost,) = publisher.events_of("gpu_lost")
    assert lost.uuid == lost_uuid and "GpuIsLost" in lost.detail
    assert len(after.devices) == 3  # answers again: sampled again
    assert _metric(collector, "gpusteward_collect_hw_events_total", kind="gpu_lost") == 1


def test_dbe_counter_increase_becomes_an_event_once(fake_nvml, publisher):
    fake = fake_nvml("faults")

    async def scenario():
        stop = asyncio.Event()
        collector = _collector(fake, publisher, interval_s=30.0)
        task = asyncio.create_task(collector.run(stop))
        await publisher.wait_for(lambda p: len(p.samples) == 1)
        await asyncio.sleep(0.1)
        fake.step()  # step 1: GPU 2 lost
        fake.step()  # step 2: one DBE on GPU 0, with NVML's DBE event
        await publisher.wait_for(lambda p: bool(p.events_of("ecc_dbe")))
        fake.step()  # step 3: GPU 1's DBE counter grows silently; its row remapping fails
        await collector.tick()  # the tick sees the counters
        stop.set()
        await asyncio.wait_for(task, 5)
        return collector

    collector = asyncio.run(scenario())
    dbe = publisher.events_of("ecc_dbe")
    assert [(e.uuid, e.count) for e in dbe] == [
        ("GPU-a0a0a0a0-0000-4000-8000-000000000000", 1),  # from the NVML event, at once
        ("GPU-a1a1a1a1-0000-4000-8000-000000000001", 2),  # from the counter, at the tick
    ]
    (remap,) = publisher.events_of("remap_failure")
    assert remap.uuid == "GPU-a1a1a1a1-0000-4000-8000-000000000001" and remap.count == 3
    last = publisher.samples[-1]
    assert [d.ecc_dbe_volatile for d in last.devices] == [1, 2]
    assert _metric(collector, "gpusteward_collect_hw_events_total", kind="ecc_dbe") == 2


def test_xid_on_a_mig_instance_names_the_mig_device(fake_nvml, publisher):
    fake = fake_nvml("mixed-node")

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(_collector(fake, publisher, interval_s=30.0).run(stop))
        await publisher.wait_for(lambda p: len(p.samples) == 1)
        await asyncio.sleep(0.1)
        fake.xid(1, 43, gpu_instance_id=2)
        fake.apply({"gpu": 1, "recovery_action": 2})
        await publisher.wait_for(lambda p: len(p.events_of("xid")) == 2)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    app_fault, recovery = publisher.events_of("xid")
    assert app_fault.xid == 43 and app_fault.uuid == "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
    assert "GPU instance 2" in app_fault.detail
    assert "MIG-aaaaaaaa-0000-4000-8000-000000000002" in app_fault.detail
    # A recovery-action change is NVML's form of Xid 154.
    assert recovery.xid == 154 and "node_reboot" in recovery.detail


def test_thermal_slowdown_start_and_stop_are_events(fake_nvml, publisher):
    fake = fake_nvml("mixed-node")
    collector = _collector(fake, publisher)

    async def scenario():
        collector.open()
        await collector.tick()  # SwPowerCap already on: a baseline, and a start
        fake.apply({"gpu": 0, "set": {"clocks_event_reasons": 0x40 | 0x01}})
        await collector.tick()  # still slowed down (now thermally): no new event
        fake.apply({"gpu": 0, "set": {"clocks_event_reasons": 0x01}})  # idle only: benign
        await collector.tick()
        collector.close()

    asyncio.run(scenario())
    kinds = [(e.kind, e.detail) for e in publisher.events if e.kind.startswith("throttle")]
    assert kinds == [("throttle_start", "sw_power_cap"), ("throttle_stop", "hw_thermal")]


def test_run_stops_promptly_and_shuts_nvml_down(fake_nvml, publisher):
    fake = fake_nvml("mixed-node")

    async def scenario() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(
            _collector(fake, publisher, interval_s=0.02, event_wait_ms=200).run(stop))
        await publisher.wait_for(lambda p: len(p.samples) >= 5)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 5)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 2.0
    # The listener's wait is bounded: its thread has ended, not been left behind.
    assert not [t for t in threading.enumerate() if t.name == "nvml-events"]
    assert not fake.initialised  # nvmlShutdown was called


def test_no_driver_is_a_clear_error(publisher):
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        _collector(NoDriver({"gpus": []}), publisher).open()


def test_fake_raises_pynvml_own_exception_classes(fake_nvml):
    fake = fake_nvml("mixed-node")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    whole = fake.nvmlDeviceGetHandleByIndex(0)
    mig_gpu = fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(mig_gpu)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 2)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait(fake.nvmlEventSetCreate(), 10)
    fake.lose(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetTemperatureV(whole, pynvml.NVML_TEMPERATURE_GPU)


@pytest.mark.parametrize(("text", "profile"), [
    ("MIG 3g.40gb", "3g.40gb"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me"),
    ("MIG 1c.3g.40gb", "3g.40gb"),
    ("NVIDIA A100-SXM4-80GB", None),
])
def test_profile_name(text, profile):
    assert profile_name(text) == profile


def test_the_nvml_protocol_is_pynvml_and_the_fake_implements_it():
    """The collector calls nothing the real module lacks, with arguments it accepts."""
    import inspect

    from gpusteward.collectors.nvml import Nvml

    calls = [name for name in vars(Nvml) if name.startswith("nvml")]
    assert len(calls) > 30
    for name in calls:
        ours = inspect.signature(getattr(Nvml, name)).parameters
        real = inspect.signature(getattr(pynvml, name)).parameters
        fake = inspect.signature(getattr(FakeNvml, name)).parameters
        required = [p for p in real.values() if p.default is inspect.Parameter.empty]
        assert len(ours) - 1 >= len(required), name
        assert len(ours) - 1 <= len(real), name
        assert list(fake)[1:] == list(ours)[1:], name


def test_collect_settings_run_the_collector_on_a_fake_nvml(nvml_data, publisher):
    """The runner ``gpusteward collect nvml`` uses takes the one CollectSettings."""
    from gpusteward.collectors.metrics import CollectorMetrics
    from gpusteward.collectors.nvml import run_nvml_collector
    from gpusteward.collectors.settings import CollectSettings, NvmlSettings

    settings = CollectSettings(node_name="demo-node", interval_s=0.02,
                               nvml=NvmlSettings(event_wait_ms=50, pod_resources_socket=None))
    metrics = CollectorMetrics()

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(run_nvml_collector(
            settings, publisher, stop, metrics,
            nvml=FakeNvml.from_yaml(nvml_data / "mixed-node.yaml")))
        await publisher.wait_for(lambda p: len(p.samples) >= 2)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert publisher.samples[0].node == "demo-node" and len(publisher.samples[0].devices) == 4
    assert (metrics.registry.get_sample_value("gpusteward_collect_samples_total",
                                              {"source": "nvml"}) or 0) >= 2


def test_a_failing_publisher_does_not_stop_the_collector(fake_nvml, publisher):
    failures: list[object] = []

    class Flaky(type(publisher)):  # type: ignore[misc]
        async def sample(self, sample):
            if not failures:
                failures.append(sample)
                raise ConnectionError("broker away")
            await super().sample(sample)

    flaky = Flaky()
    collector = _collector(fake_nvml("mixed-node"), flaky, interval_s=0.02)

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(collector.run(stop))
        await flaky.wait_for(lambda p: len(p.samples) >= 2)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert len(failures) == 1
    assert _metric(collector, "gpusteward_collect_source_errors_total", reason="tick") == 1


def test_a_gpu_already_lost_at_start_is_reported_by_index(publisher):
    fake = FakeNvml({"gpus": [
        {"uuid": "GPU-0", "name": "NVIDIA L4"},
        {"uuid": "GPU-1", "name": "NVIDIA L4", "lost": True},
    ]})
    collector = _collector(fake, publisher)
    first, second = asyncio.run(_ticks(collector, 2))
    assert [d.uuid for d in first.devices] == ["GPU-0"] == [d.uuid for d in second.devices]
    (lost,) = publisher.events_of("gpu_lost")
    assert lost.uuid is None and "GPU 1" in lost.detail and "GpuIsLost" in lost.detail


def test_restricted_container_readings_are_absent_and_each_gpu_is_logged_once(
        fake_nvml, publisher, caplog):
    """NoPermission (GPM on H100 MIG devices) and an Unknown answer mid-poll, on two GPUs,
    over three ticks: the readings are absent, and the log names each GPU once per call,
    not once per tick, nor only the first GPU."""
    caplog.set_level(logging.INFO, logger="gpusteward.collectors.nvml")
    collector = _collector(fake_nvml("restricted-container"), publisher)
    *_, last = asyncio.run(_ticks(collector, 3))

    h100s = [d for d in last.devices if d.kind == "gpu" and "H100" in (d.model or "")]
    migs = [d for d in last.devices if d.kind == "mig"]
    assert len(h100s) == 2 and len(migs) == 2
    assert all(m.engine_active_pct is None for m in migs)  # absent, never a 0 % reading
    assert all(g.pcie_replay is None and g.temp_c is not None for g in h100s)
    (t4,) = [d for d in last.devices if d.model == "Tesla T4"]
    assert t4.remapped_rows_correctable is None and t4.remap_pending is None

    def lines(level: int, call: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == level and call in r.getMessage()]

    no_permission = lines(logging.WARNING, "nvmlGpmMigSampleGet")
    assert sorted(line.split(" (")[0] for line in no_permission) == ["GPU 0", "GPU 1"]
    assert all("no permission" in line for line in no_permission)
    unknown = lines(logging.WARNING, "nvmlDeviceGetPcieReplayCounter")
    assert sorted(sum(h.uuid in line for line in unknown) for h in h100s) == [1, 1]
    assert len(lines(logging.INFO, "nvmlDeviceGetRemappedRows")) == 3  # 2 MIG H100s + the T4
    assert not lines(logging.INFO, "nvmlDeviceGetMigDeviceHandleByIndex")  # empty MIG slots
    # Every failed call is still counted, tick by tick.
    assert _metric(collector, "gpusteward_collect_source_errors_total",
                   reason="nvmlDeviceGetPcieReplayCounter") == 6


def test_driver_library_mismatch_at_start_is_one_clear_line(nvml_data):
    """`gpusteward collect nvml` on a node whose driver was upgraded without a reboot: it
    stops with one line saying so and what to do, not a traceback."""
    command = [str(Path(sys.executable).parent / "gpusteward"), "collect", "nvml",
               "--fake-nvml", str(nvml_data / "driver-mismatch.yaml"), "--node", "node-a",
               "--metrics-port", "0", "--bootstrap", "127.0.0.1:1", "--loglevel", "warning"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "LibRmVersionMismatch" in x]
    assert line.startswith("gpusteward collect nvml: NVML cannot be used here")
    assert "reboot the node" in line


def test_a_failed_mig_mode_read_keeps_the_mig_devices(fake_nvml, publisher):
    """An Unknown answer to nvmlDeviceGetMigMode mid-poll on a MIG-partitioned H100: its MIG
    devices stay in the sample, and their engine activity goes on (GPM stays primed)."""
    fake = fake_nvml("mig-node")
    collector = _collector(fake, publisher)

    async def scenario():
        collector.open()
        try:
            first = await collector.tick()
            fake.gpu(0).failing = {"nvmlDeviceGetMigMode": "Unknown"}
            return first, await collector.tick()
        finally:
            collector.close()

    first, second = asyncio.run(scenario())
    migs = {d.uuid: d for d in second.devices if d.kind == "mig"}
    assert set(migs) == {d.uuid for d in first.devices if d.kind == "mig"}
    assert migs["MIG-0a1b2c3d-0000-4000-8000-000000000001"].engine_active_pct == 62.5
    assert _metric(collector, "gpusteward_collect_source_errors_total",
                   reason="nvmlDeviceGetMigMode") == 1


def test_a_gpu_answering_only_errors_is_reported_lost_after_three_reads(fake_nvml, publisher):
    """A GPU in a bad state answers every call with NVMLError_Unknown (nvidia-smi: "Unknown
    Error"): it reads as nothing at all, so unreported it would keep taking work. After
    three such reads in a row it is reported lost, once, by uuid, and left out of the
    samples; the other GPUs are sampled throughout; when it answers again it is sampled."""
    fake = fake_nvml("faults")
    collector = _collector(fake, publisher)
    broken_uuid = "GPU-a2a2a2a2-0000-4000-8000-000000000002"

    async def scenario():
        collector.open()
        try:
            before = await collector.tick()
            fake.gpu(2).broken = "Unknown"
            during = [await collector.tick() for _ in range(4)]
            fake.gpu(2).broken = None
            return before, during, await collector.tick()
        finally:
            collector.close()

    before, during, after = asyncio.run(scenario())
    assert len(before.devices) == 3
    # The first two reads may be a hiccup: the GPU is in them, with no reading at all.
    for sample in during[:2]:
        (silent,) = [d for d in sample.devices if d.uuid == broken_uuid]
        assert (silent.util_pct, silent.temp_c, silent.mem_used_bytes) == (None, None, None)
    for sample in during[2:]:
        assert [d.index for d in sample.devices] == [0, 1]
        assert all(d.util_pct is not None for d in sample.devices)
    (lost,) = publisher.events_of("gpu_lost")
    assert lost.uuid == broken_uuid and lost.node == "node-a"
    assert "NVMLError_Unknown" in lost.detail and "3 reads in a row" in lost.detail
    assert len(after.devices) == 3  # answers again: sampled again


def test_one_failed_read_of_a_gpu_is_not_a_lost_gpu(fake_nvml, publisher):
    """Errors on every call in two reads, then an answer: a hiccup, not a loss."""
    fake = fake_nvml("faults")
    collector = _collector(fake, publisher)

    async def scenario():
        collector.open()
        try:
            for _ in range(3):
                fake.gpu(2).broken = "Unknown"
                await collector.tick()
                await collector.tick()
                fake.gpu(2).broken = None
                await collector.tick()
        finally:
            collector.close()

    asyncio.run(scenario())
    assert publisher.events_of("gpu_lost") == []


@pytest.mark.parametrize(("error", "lost"), [("Unknown", True), ("NoPermission", False)])
def test_a_gpu_whose_handle_fails_at_start_is_reported_unless_it_is_the_container(
        publisher, error, lost):
    """"Unable to determine the device handle for GPU 1: Unknown Error" at start: the GPU is
    broken and reported lost by index; a handle refused for lack of permission is this
    container's setting (logged), not the GPU's fault."""
    fake = FakeNvml({"gpus": [
        {"uuid": "GPU-0", "name": "NVIDIA L4"},
        {"uuid": "GPU-1", "name": "NVIDIA L4", "broken": error},
    ]})
    collector = _collector(fake, publisher)
    first, _ = asyncio.run(_ticks(collector, 2))
    assert [d.uuid for d in first.devices] == ["GPU-0"]
    events = publisher.events_of("gpu_lost")
    if lost:
        (event,) = events
        assert event.uuid is None and "GPU 1" in event.detail and error in event.detail
    else:
        assert events == []
