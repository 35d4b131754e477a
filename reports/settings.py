"""Settings of the rollup sink, the weekly report and its recommendations.

Read from the environment with the ``GPUSTEWARD_REPORT__`` prefix (the same
spelling a nested ``report`` group of the root settings would have), e.g.
``GPUSTEWARD_REPORT__ROLLUP_DIR=/data/rollups`` or
``GPUSTEWARD_REPORT__GPU_MODELS__H100-80GB__HOURLY_USD=3.2``. Models given change the
shipped price table or add to it, never replace it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpusteward.rules.idle import IdleSettings
from gpusteward.settings import Folder


class GpuModel(BaseModel):
    """What a GPU model costs and can do, for cost figures and model advice."""

    hourly_usd: float = Field(gt=0, description="Price of one GPU for one hour, USD.")
    memory_gib: float = Field(gt=0, description="Memory of one GPU, GiB.")
    relative_compute: float = Field(
        gt=0, description="Dense throughput relative to an A100 (1.0); used to scale "
        "utilisation when judging whether a workload fits another model.")


def _default_models() -> dict[str, GpuModel]:
    # On-demand list prices per GPU-hour of the big clouds in 2025-2026, rounded; set
    # your own negotiated prices. Compute ratios are dense BF16 relative to an A100.
    return {
        "H200-141GB": GpuModel(hourly_usd=4.5, memory_gib=141, relative_compute=3.2),
        "H100-80GB": GpuModel(hourly_usd=3.5, memory_gib=80, relative_compute=3.2),
        "A100-80GB": GpuModel(hourly_usd=2.2, memory_gib=80, relative_compute=1.0),
        "A100-SXM4-40GB": GpuModel(hourly_usd=1.6, memory_gib=40, relative_compute=1.0),
        "L40S-48GB": GpuModel(hourly_usd=1.2, memory_gib=48, relative_compute=1.2),
        "A30-24GB": GpuModel(hourly_usd=0.9, memory_gib=24, relative_compute=0.53),
        "L4-24GB": GpuModel(hourly_usd=0.7, memory_gib=24, relative_compute=0.39),
        "T4-16GB": GpuModel(hourly_usd=0.35, memory_gib=16, relative_compute=0.21),
    }


class ReportSettings(BaseSettings):
    """Rollup storage, GPU prices and right-sizing policy.

    Queue wait SLOs are not here: the report reads them from the rule policy, as
    the live queue rule does (:mod:`gpusteward.reports.policy`).
    """

    model_config = SettingsConfigDict(
        env_prefix="GPUSTEWARD_REPORT__", env_nested_delimiter="__", extra="ignore"
    )

    rollup_dir: Folder = Field(
        Path("rollups"),
        description="Folder of the Parquet rollup store (one sub-folder per day).")
    queue_dir: Folder = Field(
        Path("queue-events"),
        description="Folder of the queue-event store (same layout) for the wait-time section.")
    findings_dir: Folder = Field(
        Path("findings"),
        description="Folder of the findings store (same layout): who was told, who reclaimed.")
    results_dir: Folder = Field(
        Path("action-results"),
        description="Folder of the action-result store (same layout): the executor's audit "
        "records, which say whether a reclaim the idle rule asked for was carried out.")
    archive_dir: Folder | None = Field(
        None, description="Folder that keeps every week's report (HTML, Markdown, JSON, "
        "mig-parted YAML) in a sub-folder named by ISO week; the previous week's JSON there "
        "is what the trends compare with. None: reports are not kept, no trends.")
    spill_dir: Folder | None = Field(
        None, description="Folder where the report spills the week's per-minute values for "
        "its percentiles while it runs (removed at the end). It must hold about 50 bytes per "
        "held device-minute (a whole GPU, a MIG instance or a shared GPU's holder, one "
        "minute): 0.5 MB per device held all week, about 5 GB at 10,000 GPUs "
        "(gpusteward.reports.weekly.SPILL_BYTES_PER_HELD_MINUTE). None: the system's "
        "temporary folder (TMPDIR, else /tmp).")
    webhook_url: SecretStr | None = Field(
        None, description="Slack-compatible incoming webhook the Markdown summary is posted "
        "to after each report (a secret: it is the credential). None: nothing is posted.")
    report_url: str | None = Field(
        None, description="Where readers open the full reports (e.g. the file server or "
        "bucket that serves archive_dir), linked from the webhook summary.")
    idle_holders_shown: int = Field(
        10, ge=0, description="Idle holders listed by name, most idle GPU-hours first.")
    retention_days: int = Field(
        35, ge=1, description="Days of rollups kept; 35 covers a month-on-month comparison "
        "of full weeks.")
    flush_rows: int = Field(
        50_000, ge=1, description="The sink writes a file once it holds this many rows "
        "(50 minutes of 1,000 GPUs: files of a few MB).")
    flush_interval_s: float = Field(
        300.0, gt=0, description="... or once this many seconds passed since the last write, "
        "so a small fleet's data is not held back long.")
    lateness_s: float = Field(
        60.0, ge=0, description="Seconds of event time a minute stays open after it ends for "
        "late samples, before its rollup is emitted.")
    gpu_models: dict[str, GpuModel] = Field(
        default_factory=_default_models,
        description="Price and capacity per GPU model, keyed like mig_profiles.yaml.")
    default_hourly_usd: float = Field(
        2.0, gt=0, description="Price used for a model missing from gpu_models.")

    @field_validator("gpu_models", mode="before")
    @classmethod
    def _over_the_shipped_models(cls, given: Any) -> Any:
        """Models given change the shipped table field by field, or add to it.

        pydantic-settings replaces a dict wholesale and takes ``__`` variables' names in
        lower case: ``GPU_MODELS__H100-80GB__HOURLY_USD=3.1`` alone would leave one model,
        ``h100-80gb``, with no memory or compute, and every other model at
        ``default_hourly_usd``. A shipped model is matched whatever the case.
        """
        if not isinstance(given, Mapping):
            return given
        table: dict[str, Any] = {name: model.model_dump()
                                 for name, model in _default_models().items()}
        shipped = {name.lower(): name for name in table}
        for key, value in given.items():
            name = shipped.get(str(key).lower(), str(key))
            if isinstance(value, Mapping):
                value = {**table.get(name, {}), **value}
            table[name] = value
        return table
    team_labels: list[str] = Field(
        default_factory=lambda: ["team", "gpusteward.io/team", "app.kubernetes.io/part-of"],
        description="Pod labels naming the owning team, first match wins; else the namespace.")
    idle_threshold_pct: float = Field(
        default_factory=lambda: IdleSettings().threshold_pct, ge=0, le=100,
        description="A device-minute whose peak activity stays below this (percent) is idle. "
        "Unset: the idle-holder rule's threshold in the rule policy (reports/policy.py), so "
        "the report and the live rule count the same minutes as idle.")
    percentile: float = Field(
        95.0, gt=0, le=100, description="Percentile of per-minute demand a recommendation "
        "covers (krr uses p95 for CPU).")
    memory_percentile: float = Field(
        100.0, gt=0, le=100, description="Percentile of per-minute peak memory covered: "
        "100 = the week's peak, because running out of GPU memory kills the job.")
    headroom_pct: float = Field(
        15.0, ge=0, description="Added on top of the percentile, percent (krr's memory buffer).")
    min_points: int = Field(
        60, ge=1, description="Minutes of data a workload needs before it gets a "
        "recommendation: fewer is not evidence.")
    target_util_pct: float = Field(
        80.0, gt=0, le=100, description="Busiest acceptable utilisation on a cheaper model, "
        "after scaling by relative compute.")
    actions_per_team: int = Field(
        5, ge=0, description="Workload actions listed per team, biggest saving first; the "
        "rest are summed in one line (a lead acts on a handful, not on eighty rows).")
    fragmentation_shape_gpus: int = Field(
        4, ge=1, description="Request size (whole GPUs on one node) the fragmentation chart "
        "measures: the share of free GPUs that cannot host such a request.")

    def hourly_usd(self, model: str) -> float:
        found = self.gpu_models.get(model)
        return found.hourly_usd if found else self.default_hourly_usd
