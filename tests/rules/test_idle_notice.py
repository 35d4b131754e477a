"""The owner's notice of an idle pod: one text, built from the finding, that says what was
seen, since when, what happens next and when, and how to keep the GPU."""

from __future__ import annotations

from gpusteward.rules import idle
from gpusteward.schema import Action, DeviceSample, Finding, PodRef

POD = PodRef(namespace="ml-alice", name="nb-alice-0", uid="u1")
START = 1_767_225_600.0  # 2026-01-01T00:00:00Z
SETTINGS = idle.IdleSettings()
FIRST = START + SETTINGS.grace_s + SETTINGS.window_s


def ladder(holder: idle.Holder, hours: float, s: idle.IdleSettings = SETTINGS
           ) -> tuple[list[Finding], list[Action]]:
    track = idle.IdleTrack()
    out: list[Finding | Action] = []
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=1.0)
    for i in range(int(hours * 60) + 1):
        out += idle.observe(track, "n1", sample, START + i * 60, s, holder)
    return ([o for o in out if isinstance(o, Finding)], [o for o in out if isinstance(o, Action)])


NOTEBOOK = idle.Holder(POD, START, "notebook", owner_kind="Notebook", owner_name="nb-alice")


def test_first_notice_says_what_since_when_next_and_how_to_keep() -> None:
    findings, actions = ladder(NOTEBOOK, 1)
    notice = idle.owner_notice(findings[0])
    assert notice == (
        "Pod ml-alice/nb-alice-0 has held GPU GPU-1 on node n1 below 5 % activity (peak 1 %) "
        "since 2026-01-01T00:10:00Z. "
        "Next: if it stays idle, a warning at 2026-01-01T04:40:00Z; then a reclaim: only "
        "recorded as a dry run, since policy does not carry reclaims out. "
        "To keep the GPU: kubectl annotate pod -n ml-alice nb-alice-0 "
        "gpusteward.io/keep-until=<RFC 3339 time> (honoured up to 2026-01-15T00:10:00Z, the "
        "policy maximum). Or release it: stop the notebook or scale the workload to zero.")
    # The Event's text is the action's reason: the same words.
    assert actions[0].verb == "notify_owner" and actions[0].reason == notice


def test_warning_names_the_reclaim_by_owner_kind_and_its_time() -> None:
    s = idle.IdleSettings(reclaim_execute=True)
    findings, actions = ladder(NOTEBOOK, 14, s)
    warn = idle.owner_notice(findings[1])
    assert warn is not None and actions[1].reason == warn
    reclaim_at = idle.rfc3339(FIRST + s.warn_after_s + s.reclaim_after_s)
    assert (f"Next: if it stays idle, a reclaim at {reclaim_at}: Notebook nb-alice is stopped "
            "(kubeflow-resource-stopped).") in warn
    last = idle.owner_notice(findings[2])
    assert last is not None and "Reclaim now: Notebook nb-alice is stopped" in last


def test_reclaim_per_owner_kind_and_policy() -> None:
    s = idle.IdleSettings(reclaim_execute=True)
    cases = [
        (idle.Holder(POD, START, "notebook", owner_kind="Deployment", owner_name="web"),
         "Deployment web is scaled to zero"),
        (idle.Holder(POD, START, "batch", owner_kind="Job", owner_name="train", queue="q"),
         "its Kueue workload (Job train) is requeued"),
        (idle.Holder(POD, START, "batch", owner_kind="Job", owner_name="train"),
         "the pod is deleted and Job train recreates it"),
        (idle.Holder(POD, START, "notebook"),
         "refused: the pod has no controller"),
        (idle.Holder(POD, START, "notebook", owner_kind="RayCluster", owner_name="r"),
         "refused: the pod is owned by RayCluster r"),
    ]
    for holder, effect in cases:
        findings, _ = ladder(holder, 14, s)
        assert effect in (idle.owner_notice(findings[1]) or ""), holder
    bare = idle.IdleSettings(reclaim_execute=True, reclaim_bare_pods=True)
    findings, _ = ladder(idle.Holder(POD, START, "notebook"), 14, bare)
    assert "the pod is deleted (no controller owns it)" in (idle.owner_notice(findings[1]) or "")


def test_inference_is_told_nothing_more_follows() -> None:
    findings, _ = ladder(idle.Holder(POD, START, "inference"), 30)
    first, warn = (idle.owner_notice(f) or "" for f in findings[:2])
    assert "a warning at" in first and "this workload kind is never reclaimed" in first
    assert "Next: nothing more" in warn


def test_a_hold_is_named_with_its_end_and_the_step_after_it() -> None:
    until = FIRST + 3600 * 24
    holder = idle.Holder(POD, START, "notebook",
                         annotations={idle.KEEP_UNTIL_ANNOTATION: idle.rfc3339(until)})
    findings, actions = ladder(holder, 1)
    assert actions == []  # no notice while held, but the finding still carries the text
    notice = idle.owner_notice(findings[0]) or ""
    assert (f"Left alone until {idle.rfc3339(until)} as its gpusteward.io/keep-until "
            f"annotation asks. After that: Next: if it stays idle, a warning at "
            f"{idle.rfc3339(until)}") in notice


def test_annotation_ignored_by_policy_is_said_and_other_findings_get_none() -> None:
    findings, _ = ladder(NOTEBOOK, 1, idle.IdleSettings(keep_until_max_s=0))
    assert "has no effect here: policy ignores it" in (idle.owner_notice(findings[0]) or "")
    resolved = idle.release(idle.IdleTrack(open_id="x", open_fingerprint="f", open_pod=POD,
                                           open_since=START), "n1", "GPU-1", START + 1)[0]
    assert isinstance(resolved, Finding) and idle.owner_notice(resolved) is None
