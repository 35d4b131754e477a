"""Settings shared by every gpusteward process.

Grouped models, read from the environment with the ``GPUSTEWARD_`` prefix and
``__`` between levels (``GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS``); command-line
flags override them. Every field says its unit and why its default is what
it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpusteward.errors import ConfigError


def host_ports(servers: str) -> str:
    """``servers`` when it is a comma-separated list of ``host[:port]``; else a ValueError
    naming the entry. Checked at start: aiokafka's own parse fails later, in a traceback
    that names neither the setting nor the entry."""
    for entry in (part.strip() for part in servers.split(",")):
        if entry.startswith("["):  # [IPv6]:port
            host, _, rest = entry[1:].partition("]")
            port: str | None = rest[1:] if rest.startswith(":") else None
            if rest and port is None:
                host = ""
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        else:  # a host alone (port 9092), or a bare IPv6 address
            host, port = entry, None
        if not host or (port is not None and not (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ValueError(f"{entry!r} is not host:port (a port from 1 to 65535)")
    return servers


def cluster_name(name: str) -> str:
    """``name`` without surrounding blanks; a ValueError for a control character (a newline
    would break the chat message and the Alertmanager label it becomes) or more than 63
    characters (Kubernetes' longest name segment; a label value longer than that is a
    mistake, not a cluster)."""
    name = name.strip()
    if any(not character.isprintable() for character in name):
        raise ValueError(f"{name!r} holds a control character")
    if len(name) > 63:
        raise ValueError(f"{name[:20]!r}... is {len(name)} characters long; 63 at most")
    return name


def not_a_file(path: Path) -> Path:
    """``path`` when it is a folder or does not exist yet (it will be created); a
    ValueError when a file (or anything else) is there, checked before any work that would
    be lost when the first write into it fails."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder")
    return path


Folder = Annotated[Path, AfterValidator(not_a_file)]
"""A folder gpusteward writes into: created when absent, refused when a file."""


class KafkaSettings(BaseModel):
    """How to reach Kafka and how to shape the topics gpusteward creates."""

    bootstrap_servers: Annotated[str, AfterValidator(host_ports)] = Field(
        "127.0.0.1:9092",
        description="Comma-separated host:port list. The default is the embedded broker.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description=(
            "PLAINTEXT for the embedded broker and local compose; SASL_SSL (SCRAM over TLS) "
            "on a shared cluster."
        ),
    )
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] | None = Field(
        None, description="SASL mechanism; None when not using SASL."
    )
    sasl_username: str | None = Field(None, description="SASL user; required with SASL.")
    sasl_password: SecretStr | None = Field(
        None, description="SASL password, from a Secret; required with SASL."
    )
    ssl_cafile: str | None = Field(
        None,
        description=(
            "CA bundle (PEM) that signed the brokers' certificates, e.g. Strimzi's cluster CA; "
            "None trusts the system's CAs."
        ),
    )
    ssl_certfile: str | None = Field(
        None,
        description=(
            "Client certificate (PEM) for mutual TLS, e.g. the user.crt of a Strimzi KafkaUser "
            "with `tls` authentication or an MSK client certificate; None presents none. "
            "Needs ssl_keyfile."
        ),
    )
    ssl_keyfile: str | None = Field(
        None, description="Private key (PEM, unencrypted) of ssl_certfile; None without it."
    )
    fetch_max_wait_ms: int = Field(
        20,
        ge=1,
        le=10_000,
        description=(
            "Longest a consumer fetch may wait for data, in ms. Low by default because the "
            "embedded broker holds every fetch for up to half of this even when data is "
            "waiting; on real Kafka 100-500 ms saves requests at no latency cost."
        ),
    )
    node_partitions: int = Field(
        8,
        ge=1,
        description=(
            "Partitions of the node-keyed topics (samples, hw-events, allocations, rollups). "
            "They must be equal so the join stays local; one stream worker per partition at most."
        ),
    )
    replication_factor: int = Field(
        1, ge=1, description="Replication of created topics; 3 on a production cluster."
    )
    rebalance_timeout_s: float = Field(
        3.0,
        gt=0,
        description=(
            "Consumer-group rebalance timeout, seconds. The embedded broker waits about half "
            "of it before completing a join, so small values start workers fast."
        ),
    )

    session_timeout_s: float = Field(
        6.0,
        gt=0,
        le=300,
        description=(
            "Consumer-group session timeout, seconds: how long a member that stopped "
            "heartbeating (killed, frozen, cut off) keeps its partitions before the group "
            "hands them to the others, so survivors resume about this long after a crash. "
            "6 is the least Kafka accepts by default (group.min.session.timeout.ms); the "
            "embedded broker also holds a join for half of it (a restart measured 15 s at 10, "
            "10 s at 6). Raise it where the network or GC pauses are slow."
        ),
    )
    group_instance_id: str | None = Field(
        None,
        description=(
            "Static group membership (KIP-345) for the stream worker: a stable, unique name "
            "per worker (a StatefulSet pod's name). A worker restarted under the same name "
            "takes its partitions back at once instead of waiting a session timeout for its "
            "old self to expire, and a restart causes no rebalance. None: dynamic membership "
            "(a clean shutdown leaves the group; a crash costs one session timeout)."
        ),
    )

    max_message_bytes: int = Field(
        1_000_000,
        ge=16_384,
        le=100_000_000,
        description=(
            "Largest record the stream worker sends, in bytes: at most the brokers' "
            "message.max.bytes (1 MiB by default) and the changelog topics' "
            "max.message.bytes. The fleet agent writes a state larger than half of it "
            "in parts (about 140 bytes per workload the queue follows: 1 MB at about 7,000 "
            "running GPU pods); a larger record would be refused and stop the worker."
        ),
    )

    @model_validator(mode="after")
    def _sasl_is_complete(self) -> KafkaSettings:
        # Caught here, at start, rather than as an opaque authentication failure later.
        if self.security_protocol.startswith("SASL_"):
            missing = [
                name
                for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs "
                    + ", ".join(f"kafka.{name}" for name in missing)
                )
        elif self.sasl_mechanism is not None:
            raise ValueError(
                f"kafka.sasl_mechanism is set but security_protocol is {self.security_protocol}; "
                "use SASL_SSL or SASL_PLAINTEXT"
            )
        # A CA or a client certificate under a protocol without TLS would be ignored: the
        # process would connect in plaintext to a listener it was meant to trust.
        tls_files = [name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
                     if getattr(self, name) is not None]
        if tls_files and not self.security_protocol.endswith("SSL"):
            raise ValueError(
                ", ".join(f"kafka.{name}" for name in tls_files)
                + f" set but security_protocol is {self.security_protocol}, which uses no TLS; "
                "use SSL or SASL_SSL"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("kafka.ssl_certfile and kafka.ssl_keyfile go together (mutual TLS)")
        return self

    def faust_credentials(self) -> Any:
        """The same connection security as a Faust ``broker_credentials`` value.

        None for PLAINTEXT. Faust builds its aiokafka clients from this
        object, not from keyword arguments, so the worker passes it to
        ``faust.App(broker_credentials=...)``.
        """
        import faust

        if self.security_protocol == "PLAINTEXT":
            return None
        ssl_context = self._ssl_context() if self.security_protocol.endswith("SSL") else None
        if self.security_protocol == "SSL":
            return faust.SSLCredentials(ssl_context)
        password = self.sasl_password.get_secret_value() if self.sasl_password else None
        return faust.SASLCredentials(
            username=self.sasl_username,
            password=password,
            ssl_context=ssl_context,
            mechanism=self.sasl_mechanism,
        )

    def _ssl_context(self) -> Any:
        import ssl

        from aiokafka.helpers import create_ssl_context

        # Checked here, where the first client needs it, and not when the settings are made:
        # the files are mounted in the pod only (doctor and the manifests' tests read the same
        # settings elsewhere). Unchecked, it is a bare FileNotFoundError or SSLError naming
        # nothing.
        files = {"SSL_CAFILE": (self.ssl_cafile, "the CA of the broker's TLS listener"),
                 "SSL_CERTFILE": (self.ssl_certfile, "this client's certificate"),
                 "SSL_KEYFILE": (self.ssl_keyfile, "the key of this client's certificate")}
        for name, (path, what) in files.items():
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"GPUSTEWARD_KAFKA__{name}={path}: no such file ({what})")
        try:
            return create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile,
                                      keyfile=self.ssl_keyfile)
        except ssl.SSLError as error:
            named = ", ".join(f"GPUSTEWARD_KAFKA__{name}={path}"
                              for name, (path, _) in files.items() if path is not None)
            raise ConfigError(f"{named}: not usable as PEM ({error.reason or error}): a CA "
                              "bundle, a certificate and its matching key") from error

    def aiokafka_config(self) -> dict[str, Any]:
        """Connection keyword arguments for aiokafka producers, consumers and admin clients."""
        config: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            config["sasl_mechanism"] = self.sasl_mechanism
            config["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                config["sasl_plain_password"] = self.sasl_password.get_secret_value()
        if self.security_protocol in ("SSL", "SASL_SSL"):
            config["ssl_context"] = self._ssl_context()
        return config


class MetricsSettings(BaseModel):
    """Where a pipeline process serves its own ``/metrics`` (:mod:`gpusteward.metrics`)."""

    port: int = Field(
        0, ge=0, le=65535,
        description=(
            "TCP port of the process's /metrics; 0 does not serve. Off by default because the "
            "demo and the tests run several processes on one host; the manifests and compose "
            "set 9464 (the OpenTelemetry exporters' port, free in every pod)."
        ),
    )
    addr: str = Field("0.0.0.0", description="Address /metrics binds; 0.0.0.0 for a scraper.")


class Settings(BaseSettings):
    """Root settings of a gpusteward process."""

    model_config = SettingsConfigDict(
        env_prefix="GPUSTEWARD_", env_nested_delimiter="__", extra="ignore"
    )

    kafka: KafkaSettings = KafkaSettings()
    metrics: MetricsSettings = MetricsSettings()
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "Port of the process's /livez and /readyz (gpusteward.health); 0 serves none. "
            "Off by default so local runs of several processes do not collide; the "
            "manifests set it for their probes."
        ),
    )
    topic_prefix: str = Field(
        "gpusteward",
        description="Prefix of every topic name; change it to run two pipelines on one cluster.",
    )
    cluster: Annotated[str, AfterValidator(cluster_name)] = Field(
        "",
        description=(
            "Name of the Kubernetes cluster this pipeline watches, for people and systems that "
            "see several: the `cluster` label of every Alertmanager alert (an identifying "
            "label, so two clusters' alerts on same-named nodes never merge, and one "
            "cluster's resolutions end none of the other's), the chat messages and the weekly "
            "report's title and summary. Read by `gpusteward alerts` and `gpusteward report`. "
            "Empty (the default): no label and no name shown, as for a single cluster; set it "
            "on every cluster whose alerts share an Alertmanager."
        ),
    )
    quiet_partition_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Seconds of the stream worker's own clock without any record of a node-topic "
            "partition it holds after which that partition counts as quiet: the hardware "
            "node actions (cordon, taint, drain) still asked for of its nodes, whose "
            "collectors have stopped, are asked for again by the newest sample of the "
            "worker's other partitions. Twice the longest sample interval a collector is "
            "set to (60 s), so a partition with one live node is never taken for quiet."
        ),
    )
    max_event_ahead_s: float = Field(
        900.0,
        gt=0,
        description=(
            "Seconds a record's event time (set by the clock of the node or watcher that "
            "produced it) may run ahead of the stream worker's clock; a record further ahead "
            "is dead-lettered with the skew it shows. Event time only moves forward in the "
            "node join and the fleet agent, so one record from a collector whose clock is a "
            "day (or four years) fast would make every later record of its node look late "
            "for that long. 15 min: NTP keeps real clocks within a second, and a node 15 "
            "minutes off is broken. Raise it for a simulation or replay whose event time "
            "runs ahead of the wall clock."
        ),
    )
