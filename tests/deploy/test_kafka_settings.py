"""Settings for a real Kafka cluster: SASL/SCRAM, TLS, and Faust's credentials.

A half-configured SASL setup must fail at start with a message that names
the missing setting, not later as an authentication timeout.
"""

from __future__ import annotations

import re

import faust
import pytest
from pydantic import ValidationError

from gpusteward.errors import ConfigError
from gpusteward.settings import KafkaSettings, Settings

pytestmark = pytest.mark.deploy


def test_plaintext_is_the_default_and_has_no_credentials():
    kafka = KafkaSettings()
    assert kafka.security_protocol == "PLAINTEXT"
    assert kafka.faust_credentials() is None
    assert "sasl_mechanism" not in kafka.aiokafka_config()


def test_sasl_scram_settings_reach_aiokafka_and_faust():
    kafka = KafkaSettings(
        bootstrap_servers="kafka-kafka-bootstrap.kafka.svc:9093",
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="gpusteward", sasl_password="s3cret",
    )
    config = kafka.aiokafka_config()
    assert config["security_protocol"] == "SASL_PLAINTEXT"
    assert config["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl_plain_username"], config["sasl_plain_password"]) == (
        "gpusteward", "s3cret")
    credentials = kafka.faust_credentials()
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.mechanism.value == "SCRAM-SHA-512"
    assert (credentials.username, credentials.password) == ("gpusteward", "s3cret")
    assert credentials.protocol.value == "SASL_PLAINTEXT"
    assert "s3cret" not in repr(kafka)


def test_sasl_ssl_builds_a_tls_context_for_both_clients():
    kafka = KafkaSettings(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
        sasl_username="gpusteward", sasl_password="s3cret",
    )
    assert kafka.aiokafka_config()["ssl_context"] is not None
    credentials = kafka.faust_credentials()
    assert credentials.protocol.value == "SASL_SSL"
    assert credentials.ssl_context is not None
    assert isinstance(KafkaSettings(security_protocol="SSL").faust_credentials(),
                      faust.SSLCredentials)


def test_a_missing_ca_file_is_an_error_at_start_not_a_silent_fallback(tmp_path):
    absent = tmp_path / "absent.crt"
    kafka = KafkaSettings(security_protocol="SSL", ssl_cafile=str(absent))
    with pytest.raises(ConfigError, match=f"GPUSTEWARD_KAFKA__SSL_CAFILE={absent}: no such file"):
        kafka.aiokafka_config()
    with pytest.raises(ConfigError, match="no such file"):
        kafka.faust_credentials()


@pytest.mark.parametrize("servers", ["b1:9093,b2:9093", "kafka", "[::1]:9092",
                                     " b1:9093 , b2:1"])
def test_host_port_lists_are_accepted(servers):
    assert KafkaSettings(bootstrap_servers=servers).bootstrap_servers == servers


@pytest.mark.parametrize(("servers", "entry"), [
    ("127.0.0.1:abc", "127.0.0.1:abc"), ("b1:9093,b2:0", "b2:0"), ("b1:70000", "b1:70000"),
    ("b1:9093,,b2:9093", ""), (":9092", ":9092"), ("[::1]x", "[::1]x"),
])
def test_a_bad_host_port_names_the_entry(servers, entry):
    with pytest.raises(ValidationError, match=re.escape(f"{entry!r} is not host:port")):
        KafkaSettings(bootstrap_servers=servers)


@pytest.mark.parametrize("missing", ["sasl_mechanism", "sasl_username", "sasl_password"])
def test_incomplete_sasl_names_what_is_missing(missing):
    values = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
              "sasl_username": "gpusteward", "sasl_password": "s3cret"}
    del values[missing]
    with pytest.raises(ValidationError, match=f"kafka.{missing}"):
        KafkaSettings(**values)


def test_mechanism_without_a_sasl_protocol_is_refused():
    with pytest.raises(ValidationError, match="SASL_SSL or SASL_PLAINTEXT"):
        KafkaSettings(sasl_mechanism="SCRAM-SHA-512")


def test_unknown_protocol_and_mechanism_are_refused():
    with pytest.raises(ValidationError):
        KafkaSettings(security_protocol="TLS")
    with pytest.raises(ValidationError):
        KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="KERBEROS",
                      sasl_username="u", sasl_password="p")


def test_environment_variables_configure_real_kafka(monkeypatch):
    for name, value in {
        "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": "b1:9093,b2:9093,b3:9093",
        "GPUSTEWARD_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "GPUSTEWARD_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "GPUSTEWARD_KAFKA__SASL_USERNAME": "gpusteward",
        "GPUSTEWARD_KAFKA__SASL_PASSWORD": "s3cret",
        "GPUSTEWARD_KAFKA__NODE_PARTITIONS": "24",
        "GPUSTEWARD_KAFKA__REPLICATION_FACTOR": "3",
        "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS": "250",
    }.items():
        monkeypatch.setenv(name, value)
    kafka = Settings().kafka
    assert kafka.bootstrap_servers == "b1:9093,b2:9093,b3:9093"
    assert (kafka.node_partitions, kafka.replication_factor, kafka.fetch_max_wait_ms) == (
        24, 3, 250)
    assert kafka.sasl_password is not None
    assert kafka.sasl_password.get_secret_value() == "s3cret"


def test_stream_worker_uses_the_kafka_credentials(tmp_path):
    from gpusteward.streams import app as worker_app

    settings = Settings(kafka=KafkaSettings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="gpusteward", sasl_password="s3cret",
    ))
    faust_app = worker_app.create_app(settings, datadir=str(tmp_path))
    credentials = faust_app.conf.broker_credentials
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.username == "gpusteward"
