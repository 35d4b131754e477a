"""Detection rules: pure functions of state and events, no I/O and no clocks.

Each rule lives in its own module with a typed settings model whose field
descriptions are its documentation. Rules are registered here by name (the
name is also the ``kind`` of the findings they emit and the key of their
section in the policy file); :func:`settings_model` raises an error listing
the valid names for an unknown one.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpusteward.errors import ConfigError
from gpusteward.rules import ecc, hardware, idle, xid
from gpusteward.rules import fragmentation as fleet_fragmentation
from gpusteward.rules import queue as fleet_queue
from gpusteward.rules import spot as fleet_spot

REGISTRY: dict[str, type[BaseModel]] = {
    idle.KIND: idle.IdleSettings,
    ecc.KIND: ecc.EccSettings,
    hardware.SBE_KIND: hardware.SbeRateSettings,
    hardware.PCIE_KIND: hardware.PcieReplaySettings,
    hardware.NVLINK_KIND: hardware.NvlinkErrorSettings,
    hardware.REMAP_FAILURE_KIND: hardware.RemapFailureSettings,
    hardware.REMAP_PENDING_KIND: hardware.RemapPendingSettings,
    hardware.GPU_LOST_KIND: hardware.GpuLostSettings,
    hardware.THERMAL_KIND: hardware.ThermalSettings,
    hardware.RECOVERY_KIND: hardware.RecoveryActionSettings,
    xid.KIND: xid.XidSettings,
}
# Fleet-wide rules (the fleet agent in streams/fleet.py).
REGISTRY[fleet_fragmentation.KIND] = fleet_fragmentation.FragmentationSettings
REGISTRY[fleet_queue.WAIT_KIND] = fleet_queue.QueueSloSettings
REGISTRY[fleet_spot.KIND] = fleet_spot.SpotSettings


class UnknownRuleError(ConfigError, KeyError):
    """A rule name that is not registered."""

    def __str__(self) -> str:
        return f"unknown rule {self.args[0]!r}; valid rules: {', '.join(sorted(REGISTRY))}"


def settings_model(name: str) -> type[BaseModel]:
    """The settings model of the rule called ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownRuleError(name) from None
