"""XID errors: classified by NVIDIA's catalog into action classes, acted on by class.

The catalog (``xid_catalog.yaml``, shipped with the package, a copy of the
project's reference data) maps each XID to an ``action_class``: what a
fleet does about it. This rule counts the XIDs of each class per GPU in a
sliding event-time window and opens one episode per (GPU, class) when the
class's repeat threshold is reached:

==================  ==========================================  ==============
class               action                                      default
==================  ==========================================  ==============
restart_app         finding only: warning across workloads       5 in 24 h
reset_gpu           taint ``gpusteward.io/gpu-reset-required``   1
reboot_node         drain the node                               1
drain_and_rma       cordon, critical, RMA runbook                1
follow_workflow     cordon (fatal, needs NVIDIA's workflow)      1
none, follow_other  nothing                                      off
==================  ==========================================  ==============

Two XIDs are news another rule reports with more to go on: Xid 48 (double-bit
ECC) is the ``ecc_dbe`` rule's, which also reads the DBE counter and closes
when a reset clears it; Xid 79 (fallen off the bus) is ``gpu_lost``'s, which
also takes NVML's GPU-unavailable event and closes when the GPU reports
again. One fault arrives as both the XID and the other signal, so this rule
leaves those XIDs to that rule (:data:`HANDED_OFF`), which opens its
episode on the XID alone as well: one fault, one finding, one action, and a
source that sends only XIDs still gets them. A policy that reclassifies
either XID, or disables its class, keeps it here (or ignored) as before.

Application-class XIDs (``restart_app``: Xid 13 graphics engine exception, 31 GPU
memory page fault, ...) are almost always the program's bug, and a crash-looping pod
repeats its own XID every few minutes. So each is recorded with the workload whose pod
held the GPU then (:func:`workload_of`: its top owner, e.g. ``Job/train``, else the pod;
the node join tells, from the allocations by device id or the collector's attribution),
and the repeat threshold opens the hardware-suspect ``warning`` only when the XIDs in
its window come from at least two workloads, or from one the join could not name. XIDs
of one workload alone open an ``info`` finding that names its pod and says the error is
the application's (no page for the platform team; a record its owner and the team can
point at); the same episode is re-issued as the ``warning`` once another workload hits
the GPU within the window, which is the runbook's own reasoning.

On top of that, fatal XIDs (the catalog's ``fatal_nvsentinel: FATAL``)
repeating on one GPU despite the per-class actions (default 5 in 24 h)
open an ``xid_rma`` episode: cordon and escalate to the vendor.

An episode stays open while XIDs of its class keep coming and closes after
a quiet window with none (checked on the device's samples). Events are
deduplicated on (time, XID); a late event older than the end of the last
closed episode of its class cannot reopen it.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Literal

import msgspec
import yaml
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.idle import Holder
from gpusteward.schema import Action, Evidence, Finding, Subject

KIND = "xid"
RMA_KIND = "xid_rma"

ActionClass = Literal[
    "none", "restart_app", "reset_gpu", "reboot_node", "drain_and_rma", "follow_workflow",
    "follow_other_xid",
]

MAX_RECENT = 256
"""Most XIDs remembered per GPU."""

APP_CLASS = "restart_app"
"""The class whose XIDs are judged by the workloads that hit them."""

XID_DBE = 48
"""ROBUST_CHANNEL_GPU_ECC_DBE: reported by the ``ecc_dbe`` rule."""
XID_OFF_THE_BUS = 79
"""ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS: reported by the ``gpu_lost`` rule."""
HANDED_OFF: dict[int, str] = {XID_DBE: "ecc_dbe", XID_OFF_THE_BUS: "gpu_lost"}
"""XID -> the rule that reports it in place of this one (:meth:`XidSettings.hands_off`)."""

RESET_TAINT = {"key": "gpusteward.io/gpu-reset-required", "effect": "NoSchedule"}

RUNBOOKS: dict[str, str] = {
    "restart_app": "Workloads on this GPU keep hitting an application-class XID, and not one "
    "workload alone (its labels name them; 'unknown': no holder was known). One is a "
    "program bug; a repeat on the same GPU across workloads points at the hardware: check "
    "`nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER` and PCIe replay counters, and move the "
    "workload to another GPU to compare.",
    "reset_gpu": "The GPU needs a reset before it can be trusted (NVIDIA bucket RESET_GPU). The "
    "node is tainted gpusteward.io/gpu-reset-required:NoSchedule. Stop the pods on the GPU, run "
    "`nvidia-smi -r -i <index>` (or reboot the node), check the XID clears, then remove the taint.",
    "reboot_node": "The GPU is unreachable or needs a host restart (NVIDIA bucket RESTART_BM). "
    "The node is drained: reboot it, check `nvidia-smi` lists every GPU, then uncordon. If it "
    "recurs after a reboot, open an RMA.",
    "drain_and_rma": "An XID that should never appear on this hardware (NVIDIA bucket "
    "CONTACT_SUPPORT). The node is cordoned: drain it, collect `nvidia-bug-report.sh` and open a "
    "support case / RMA with the vendor.",
    "follow_workflow": "A fatal XID whose handling depends on details (NVIDIA WORKFLOW_* "
    "bucket, e.g. Xid 74 NVLink). The node is cordoned: follow NVIDIA's workflow "
    "for this XID in the XID catalog; usually a GPU reset, an RMA if it recurs.",
}

APP_RUNBOOK = (
    "Only one workload hit these application-class XIDs on this GPU (e.g. Xid 13 graphics "
    "engine exception, Xid 31 GPU memory page fault: an illegal address or a bad kernel in "
    "the program): the application's error, not the GPU's; nothing is asked of the node. "
    "Tell the workload's owner (its pod is named here) to check its CUDA code and its "
    "container's restarts. If another workload hits them on this GPU, this finding becomes "
    "a warning: then suspect the hardware."
)

RMA_RUNBOOK = (
    "Fatal XIDs keep recurring on this GPU despite resets: treat it as failing hardware. The "
    "node is cordoned. Drain it, run NVIDIA field diagnostics (`dcgmi diag -r 3`), collect "
    "`nvidia-bug-report.sh` and open an RMA with the vendor."
)


class XidInfo(msgspec.Struct, frozen=True):
    """One catalog entry, as far as the rule needs it."""

    xid: int
    mnemonic: str
    action_class: ActionClass
    fatal: bool


@functools.cache
def catalog() -> dict[int, XidInfo]:
    """The shipped XID catalog by XID number (ranges expanded), read once per process."""
    text = resources.files(__package__).joinpath("xid_catalog.yaml").read_text()
    return parse_catalog(text)


def parse_catalog(text: str) -> dict[int, XidInfo]:
    """Parse catalog YAML (the reference data's format) into :class:`XidInfo` by number."""
    out: dict[int, XidInfo] = {}
    for entry in yaml.safe_load(text)["xids"]:
        if "xid_range" in entry:
            low, high = entry["xid_range"]
            numbers = range(int(low), int(high) + 1)
            mnemonic = "/".join(entry.get("mnemonics", []))
        else:
            numbers = range(int(entry["xid"]), int(entry["xid"]) + 1)
            mnemonic = entry.get("mnemonic", "")
        for number in numbers:
            out[number] = XidInfo(number, mnemonic, entry["action_class"],
                                  entry.get("fatal_nvsentinel") == "FATAL")
    return out


class XidClassPolicy(BaseModel):
    """When XIDs of one action class open an episode."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="False ignores XIDs of this class entirely.")
    min_count: int = Field(1, ge=1, description="XIDs of the class on one GPU within window_s "
                           "that open an episode (1 acts on the first).")
    window_s: float = Field(86400, gt=0, description="Counting window, seconds of event time; "
                            "also the quiet time after the last XID that closes the episode.")


def _default_classes() -> dict[ActionClass, XidClassPolicy]:
    return {
        "none": XidClassPolicy(enabled=False),
        "follow_other_xid": XidClassPolicy(enabled=False),
        "restart_app": XidClassPolicy(min_count=5, window_s=86400),
        "reset_gpu": XidClassPolicy(),
        "reboot_node": XidClassPolicy(),
        "drain_and_rma": XidClassPolicy(),
        "follow_workflow": XidClassPolicy(),
    }


class XidSettings(BaseModel):
    """Settings of the XID rule."""

    model_config = ConfigDict(extra="forbid")

    classes: dict[ActionClass, XidClassPolicy] = Field(
        default_factory=_default_classes,
        description="Repeat threshold per action class. Defaults: act on the first fatal XID "
        "(reset_gpu, reboot_node, drain_and_rma, follow_workflow); application-class XIDs when 5 "
        "hit one GPU within 24 h (one is a program bug; five from two workloads suggest the "
        "GPU, a warning; five from one are its own error, an info finding); 'none' and "
        "'follow_other_xid' (45, 154: they accompany another XID) are ignored.",
    )
    reclassify: dict[int, ActionClass] = Field(
        default_factory=dict,
        description="Per-XID override of the catalog's action class, e.g. {13: none} to ignore "
        "graphics exceptions on a fleet of experimental code.",
    )
    unknown_class: ActionClass = Field(
        "none", description="Action class of an XID the catalog does not list. 'none': the "
        "catalog holds every XID that matters for remediation.",
    )
    rma_count: int = Field(
        5, ge=1, description="Fatal XIDs on one GPU within rma_window_s that escalate to RMA "
        "(cordon, critical): the GPU keeps failing despite resets.",
    )
    rma_window_s: float = Field(86400, gt=0, description="Window of rma_count, seconds.")
    cordon_on_rma: bool = Field(True, description="Ask to cordon the node on an RMA escalation.")

    def classify(self, xid: int) -> tuple[ActionClass, bool]:
        """The action class and fatality of ``xid`` under these settings."""
        info = catalog().get(xid)
        cls: ActionClass = info.action_class if info else self.unknown_class
        return self.reclassify.get(xid, cls), bool(info and info.fatal)

    def judges_by_holder(self, xid: int) -> bool:
        """True for an XID whose judgement depends on who held the GPU: one of the
        application class, enabled (:data:`APP_CLASS`)."""
        cls, fatal = self.classify(xid)
        policy = self.classes.get(cls)
        return cls == APP_CLASS and not fatal and policy is not None and policy.enabled

    def hands_off(self, xid: int) -> bool:
        """True for an XID this rule leaves to the rule :data:`HANDED_OFF` names: one this
        rule would act on as the catalog classes it (not reclassified, its class enabled).
        It still counts towards ``rma_count``."""
        if xid not in HANDED_OFF or xid in self.reclassify:
            return False
        policy = self.classes.get(self.classify(xid)[0])
        return policy is not None and policy.enabled


class XidEpisode(msgspec.Struct, omit_defaults=True):
    id: str
    fingerprint: str
    since: float
    last_ts: float
    workload: str | None = None
    """An application-class episode of one workload so far (its ``info`` finding): that
    workload; None: any other episode (a state from before this field holds only those)."""


class Occurrence(msgspec.Struct, array_like=True):
    """One XID on the GPU. Encoded as an array, as the tuple it replaces: a state from
    before ``workload`` decodes, its XIDs of no known workload."""

    ts: float
    xid: int
    cls: str
    fatal: bool
    workload: str | None = None
    """Application-class XIDs only: the workload whose pod held the GPU at ``ts``
    (:func:`workload_of`); None: not known, or another class."""


class XidTrack(msgspec.Struct, omit_defaults=True):
    """Per-GPU state: recent XIDs and open episodes by class."""

    recent: list[Occurrence] = []
    open: dict[str, XidEpisode] = {}
    closed_until: dict[str, float] = {}
    """Per class, the end of the last closed episode: older late events cannot reopen it."""


def workload_of(holder: Holder | None) -> str | None:
    """The workload of a GPU's holder, as the XID rule tells workloads apart: its top owner
    (``namespace/Deployment/web``; the retries of a Job and the restarts of a crash-looping
    Deployment are one workload), else the pod by name; None: no holder known."""
    if holder is None:
        return None
    pod = holder.pod
    if holder.owner_kind and holder.owner_name:
        return f"{pod.namespace}/{holder.owner_kind}/{holder.owner_name}"
    return f"{pod.namespace}/{pod.name}"


def _one_workload(window: list[Occurrence]) -> str | None:
    """The one workload every XID of ``window`` came from; None when they span two or more,
    or one came from a holder not known (the hardware is then the suspect)."""
    first = window[0].workload
    if first is None or any(r.workload != first for r in window):
        return None
    return first


def _by_time(r: Occurrence) -> tuple[float, int]:
    return r.ts, r.xid


def _densest(occurrences: list[Occurrence], ts: float, window_s: float) -> list[Occurrence]:
    """The fullest window of ``window_s`` that holds the event at ``ts``.

    Events can arrive out of order, so the window that crosses a threshold may end after
    ``ts``: try every window (end - window_s, end] with an end from ts to ts + window_s.
    """
    ends = sorted({r.ts for r in occurrences if ts <= r.ts < ts + window_s})
    best: list[Occurrence] = []
    for end in ends:
        inside = [r for r in occurrences if end - window_s < r.ts <= end]
        if len(inside) > len(best):
            best = inside
    return sorted(best, key=_by_time)


def _verb_for(cls: str) -> tuple[Literal["cordon", "taint", "drain"] | None, dict[str, str]]:
    if cls == "reset_gpu":
        return "taint", dict(RESET_TAINT)
    if cls == "reboot_node":
        return "drain", {}
    if cls in ("drain_and_rma", "follow_workflow"):
        return "cordon", {}
    return None, {}


def observe_event(track: XidTrack, *, node: str, uuid: str, xid: int, ts: float,
                  settings: XidSettings, holder: Holder | None = None
                  ) -> list[Finding | Action]:
    """Fold one XID event into ``track``; return the findings and actions it causes.

    ``holder``: the pod that held the GPU at ``ts``, as the node join knows it (None: not
    known); it tells the workloads apart for application-class XIDs."""
    cls, fatal = settings.classify(xid)
    policy = settings.classes.get(cls)
    if not fatal and (policy is None or not policy.enabled):
        return []  # ignored, and kept out of the history so a storm of it pushes nothing out
    if any(r.ts == ts and r.xid == xid for r in track.recent):
        return []  # a redelivered event
    keep_s = max(settings.rma_window_s,
                 *(p.window_s for p in settings.classes.values()))
    newest = max(ts, max((r.ts for r in track.recent), default=ts))
    track.recent = [r for r in track.recent if r.ts > newest - keep_s]
    track.recent.append(Occurrence(ts, xid, cls, fatal,
                                   workload_of(holder) if cls == APP_CLASS else None))
    if len(track.recent) > MAX_RECENT:
        # An XID storm: keep the newest; counts stay at least MAX_RECENT, above any threshold
        # worth setting, and the state (which rides the changelog) stays small.
        track.recent.sort(key=_by_time)
        del track.recent[:-MAX_RECENT]
    out: list[Finding | Action] = []
    subject = Subject(node=node, device=uuid)
    if not settings.hands_off(xid):  # else another rule's finding: only the RMA count below
        episode = track.open.get(cls)
        if episode is not None:
            episode.last_ts = max(episode.last_ts, ts)
            # Judged again only while one workload's alone: another may widen it.
            judge = episode.workload is not None
        else:
            judge = ts > track.closed_until.get(cls, float("-inf"))
        if judge and policy is not None and policy.enabled:
            in_window = _densest([r for r in track.recent
                                  if r.cls == cls and not settings.hands_off(r.xid)],
                                 ts, policy.window_s)
            if len(in_window) >= policy.min_count:
                out += _open(track, cls, node, uuid, subject, in_window, ts, holder)
    rma = track.open.get(RMA_KIND)
    if fatal and rma is not None:
        rma.last_ts = max(rma.last_ts, ts)  # still failing: the RMA episode goes on
    if fatal and settings.rma_count and rma is None \
            and ts > track.closed_until.get(RMA_KIND, float("-inf")):
        fatal_window = _densest([r for r in track.recent if r.fatal], ts, settings.rma_window_s)
        if len(fatal_window) >= settings.rma_count:
            out += _open_rma(track, node, uuid, subject, fatal_window, ts, settings)
    return out


def _open(track: XidTrack, cls: str, node: str, uuid: str, subject: Subject,
          window: list[Occurrence], ts: float, holder: Holder | None
          ) -> list[Finding | Action]:
    """Open the class's episode on ``window``, or re-issue an application-class one of one
    workload as the warning once ``window`` spans two (same id: an escalation)."""
    one = _one_workload(window) if cls == APP_CLASS else None
    episode = track.open.get(cls)
    if episode is not None:
        if one == episode.workload:
            return []  # still that workload's alone
        one = None  # another workload hit the GPU within the episode
    start = episode.since if episode is not None else window[0].ts
    xids = sorted({r.xid for r in window})
    fp = fingerprint(KIND, node, uuid, cls)
    fid = episode.id if episode is not None else finding_id(fp, start)
    names = ", ".join(str(x) for x in xids)
    severity: Literal["info", "warning", "critical"] = (
        "critical" if cls != APP_CLASS else "info" if one is not None else "warning")
    summary = f"Xid {names} ({cls}) on {uuid} ({node}): {len(window)} in the window"
    labels = {"action_class": cls, "xids": names}
    runbook = RUNBOOKS.get(cls, "")
    if one is not None:
        # The holder of the XID that reached the threshold is the workload's latest pod.
        pod = holder.pod if holder is not None else None
        subject = Subject(node=node, device=uuid, pod=pod)
        summary += f", all from workload {one}: the application's error, not the GPU's"
        labels["workload"] = one
        runbook = APP_RUNBOOK
    elif cls == APP_CLASS:
        workloads = sorted({r.workload or "unknown" for r in window})
        summary += f" from {len(workloads)} workloads: suspect the GPU"
        labels["workloads"] = ", ".join(workloads)
    finding = Finding(
        id=fid, fingerprint=fp, kind=KIND, severity=severity, state="firing", subject=subject,
        summary=summary, starts_at=start, ts=ts,
        evidence=Evidence(window_start=window[0].ts, window_end=max(ts, window[-1].ts),
                          samples=len(window),
                          values={"count": float(len(window)), "last_xid": float(window[-1].xid)}),
        runbook=runbook, labels=labels,
    )
    if episode is not None:
        episode.workload = None  # escalated: spans workloads from now on
        return [finding]
    track.open[cls] = XidEpisode(fid, fp, start, ts, workload=one)
    out: list[Finding | Action] = [finding]
    verb, params = _verb_for(cls)
    if verb is not None:
        action = action_for(finding, verb, Subject(node=node), finding.summary)
        action.params = params
        out.append(action)
    return out


def _open_rma(track: XidTrack, node: str, uuid: str, subject: Subject,
              window: list[Occurrence], ts: float,
              settings: XidSettings) -> list[Finding | Action]:
    start = window[0].ts
    fp = fingerprint(RMA_KIND, node, uuid)
    fid = finding_id(fp, start)
    names = ", ".join(str(x) for x in sorted({r.xid for r in window}))
    finding = Finding(
        id=fid, fingerprint=fp, kind=RMA_KIND, severity="critical", state="firing",
        subject=subject,
        summary=f"{len(window)} fatal XIDs ({names}) on {uuid} ({node}) within "
        f"{settings.rma_window_s / 3600:g} h: RMA candidate",
        starts_at=start, ts=ts,
        evidence=Evidence(window_start=start, window_end=max(ts, window[-1].ts),
                          samples=len(window), values={"fatal_xids": float(len(window))}),
        runbook=RMA_RUNBOOK, labels={"action_class": "drain_and_rma", "xids": names},
    )
    track.open[RMA_KIND] = XidEpisode(fid, fp, start, ts)
    out: list[Finding | Action] = [finding]
    if settings.cordon_on_rma:
        out.append(action_for(finding, "cordon", Subject(node=node), finding.summary))
    return out


def clock_step(track: XidTrack, step: float) -> None:
    """The node's clock went back ``step`` s: every time the track keeps moves back by it,
    so the XIDs before the step still count in their windows on the new clock."""
    for occurrence in track.recent:
        occurrence.ts -= step
    for episode in track.open.values():
        episode.since -= step
        episode.last_ts -= step
    track.closed_until = {cls: ts - step for cls, ts in track.closed_until.items()}


def expire(track: XidTrack, *, node: str, uuid: str, ts: float,
           settings: XidSettings) -> list[Finding | Action]:
    """Close the episodes with no XID of their class for their window (called on samples)."""
    out: list[Finding | Action] = []
    for cls, episode in list(track.open.items()):
        if cls == RMA_KIND:
            quiet_s = settings.rma_window_s
        else:
            policy = settings.classes.get(cls)  # type: ignore[call-overload]
            quiet_s = policy.window_s if policy is not None else settings.rma_window_s
        if ts - episode.last_ts < quiet_s:
            continue
        del track.open[cls]
        track.closed_until[cls] = ts
        kind = RMA_KIND if cls == RMA_KIND else KIND
        out.append(resolved(episode.id, episode.fingerprint, kind, Subject(node=node, device=uuid),
                            f"{uuid} on {node}: no {cls} XID for {quiet_s / 3600:g} h",
                            episode.since, ts))
    return out
