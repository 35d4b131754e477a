"""Detection rules: pure functions of state and events, no I/O and no clocks.

Each rule lives in its own module with a typed settings model whose field
descriptions are its documentation. Every rule is registered below by name,
one entry each (:class:`~gpusteward.rules.registry.Rule`): its settings,
scope, the kinds of finding it emits and how it runs. The node join, the
fleet agent, the policy and ``--enable-rule`` all read this registry, so a
new rule is its module plus one entry here. :func:`settings_model` raises an
error listing the valid names for an unknown one.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpusteward.rules import budget as fleet_budget
from gpusteward.rules import demand as fleet_demand
from gpusteward.rules import (
    ecc,
    hardware,
    idle,
    memory_high,
    memory_leak,
    memory_low_free,
    memory_overcommit,
    silent,
    xid,
)
from gpusteward.rules import eta as fleet_eta
from gpusteward.rules import fragmentation as fleet_fragmentation
from gpusteward.rules import gang as fleet_gang
from gpusteward.rules import queue as fleet_queue
from gpusteward.rules import spot as fleet_spot
from gpusteward.rules.mig import advice as mig_advice
from gpusteward.rules.mig import reconfig as mig_reconfig
from gpusteward.rules.registry import Registry, Rule, UnknownRuleError

__all__ = ["REGISTRY", "REMEDIATION_BREAKER", "Registry", "Rule", "UnknownRuleError",
           "settings_model"]

REMEDIATION_BREAKER = "remediation_breaker"
"""The kind of the finding the remediation executor publishes when its circuit breaker trips."""

REGISTRY = Registry([
    # Per device, run by the node join on every device sample and hardware event.
    Rule(idle.KIND, idle.IdleSettings, "device", layers="workload", device=idle.RUNNER),
    Rule(ecc.KIND, ecc.EccSettings, "device", device=ecc.RUNNER),
    Rule(hardware.SBE_KIND, hardware.SbeRateSettings, "device", device=hardware.RUNNER),
    Rule(hardware.PCIE_KIND, hardware.PcieReplaySettings, "device", device=hardware.RUNNER),
    Rule(hardware.NVLINK_KIND, hardware.NvlinkErrorSettings, "device", device=hardware.RUNNER),
    Rule(hardware.NVLINK_CRC_KIND, hardware.NvlinkCrcSettings, "device",
         device=hardware.RUNNER),
    Rule(hardware.REMAP_FAILURE_KIND, hardware.RemapFailureSettings, "device",
         device=hardware.RUNNER),
    Rule(hardware.REMAP_PENDING_KIND, hardware.RemapPendingSettings, "device",
         device=hardware.RUNNER),
    Rule(hardware.RETIRED_PENDING_KIND, hardware.RetiredPagesPendingSettings, "device",
         device=hardware.RUNNER),
    Rule(hardware.RETIRED_PAGES_KIND, hardware.RetiredPagesSettings, "device",
         device=hardware.RUNNER),
    Rule(hardware.GPU_LOST_KIND, hardware.GpuLostSettings, "device", device=hardware.RUNNER),
    Rule(hardware.THERMAL_KIND, hardware.ThermalSettings, "device", device=hardware.RUNNER),
    Rule(hardware.RECOVERY_KIND, hardware.RecoveryActionSettings, "device",
         device=hardware.RUNNER),
    Rule(xid.KIND, xid.XidSettings, "device", kinds=(xid.RMA_KIND,), device=hardware.RUNNER),
    Rule(memory_low_free.KIND, memory_low_free.LowFreeMemorySettings, "device",
         layers="workload", device=memory_low_free.RUNNER),
    Rule(memory_high.KIND, memory_high.HighMemorySettings, "device", device=memory_high.RUNNER),
    Rule(memory_leak.KIND, memory_leak.LeakSettings, "device", layers="workload",
         device=memory_leak.RUNNER),
    Rule(memory_overcommit.KIND, memory_overcommit.OvercommitSettings, "device",
         device=memory_overcommit.RUNNER),
    # Per node, in the node join from the node's inventory: nothing to configure.
    Rule(mig_reconfig.FAILED_KIND, None, "node",
         summary="mig-manager reported nvidia.com/mig.config.state=failed: the node is not "
         "in the MIG layout its nvidia.com/mig.config asks for (one warning, resolved by a "
         "success)."),
    # Per node, in the node join on its partition's clock (a node sends nothing).
    Rule(silent.KIND, silent.NodeSilentSettings, "node"),
    # Per node, beside the node join (the fleet agent's ``fleet-spot``, partitioned by node).
    Rule(fleet_spot.KIND, fleet_spot.SpotSettings, "node"),
    # Fleet-wide, run by the fleet agent (streams/fleet.py).
    Rule(fleet_queue.WAIT_KIND, fleet_queue.QueueSloSettings, "fleet",
         kinds=(fleet_queue.P95_KIND, fleet_queue.PROJECTED_KIND), fleet=fleet_queue.RUNNERS),
    Rule(fleet_fragmentation.KIND, fleet_fragmentation.FragmentationSettings, "fleet",
         kinds=(fleet_fragmentation.STRANDED_KIND,), fleet=fleet_fragmentation.RUNNERS),
    Rule(fleet_gang.KIND, fleet_gang.GangSettings, "fleet", kinds=(fleet_gang.IDLE_KIND,),
         fleet=fleet_gang.RUNNERS),
    Rule(fleet_demand.KIND, fleet_demand.DemandReclaimSettings, "fleet",
         fleet=fleet_demand.RUNNERS),
    Rule(fleet_eta.KIND, fleet_eta.EtaSettings, "fleet", fleet=fleet_eta.RUNNERS),
    Rule(fleet_budget.KIND, fleet_budget.BudgetSettings, "fleet",
         kinds=(fleet_budget.PROJECTED_KIND,), fleet=fleet_budget.RUNNERS),
    # Run by the fleet agent on its own cadence, in a thread (a solver search, not a check).
    Rule(mig_advice.KIND, mig_advice.MigAdviceSettings, "fleet"),
    # Emitted by the remediation executor, not a worker: a fleet-wide guard over every
    # action, configured by RemediationSettings (GPUSTEWARD_REMEDIATION__*), so it has no
    # policy section. Registered so that `rules list` names every kind the pipeline emits.
    Rule(REMEDIATION_BREAKER, None, "fleet", owner="remediation",
         summary="The remediation executor's circuit breaker tripped (too many nodes "
         "disrupted in its window); settings: GPUSTEWARD_REMEDIATION__BREAKER_*."),
])


def settings_model(name: str) -> type[BaseModel]:
    """The settings model of the rule called ``name``."""
    model = REGISTRY[name].settings
    if model is None:
        raise UnknownRuleError(name, REGISTRY.configurable(), "configurable rule")
    return model
