"""gpusteward's processes on a secured Kafka: TLS with a private CA, mutual TLS, SASL/SCRAM.

Every client is real and so is the broker behind it: the embedded broker (Tansu) behind a
TLS listener of this module's (Kafka's SSL is TLS around the same protocol, so a client
meets the handshake a Strimzi or MSK TLS listener makes), and Tansu's own SASL/SCRAM with
``--authentication``. Tansu keeps its users in its store, and its memory store starts with
none that a client could create one with, so a login it accepts is the one case tested
only where a real cluster is named (:func:`test_a_scram_login_a_real_cluster_accepts`).

What a team relies on: each process (the Faust worker and every aiokafka client) connects
with the same settings; a wrong password, an untrusted certificate or a missing client
certificate ends the start within seconds with a line naming the setting, not a 30 s
"did not answer"; the password is never printed.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from gpusteward import kafka, topics
from gpusteward.broker import free_port, tansu_binary
from gpusteward.errors import ConfigError
from gpusteward.health import probe
from gpusteward.settings import KafkaSettings, Settings

pytestmark = pytest.mark.deploy

PASSWORD = "hunter2-do-not-print"


def openssl(*argv: str | Path) -> None:
    subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private CA, the broker's certificate for 127.0.0.1, a client certificate, and a
    second CA that signed neither."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make the test certificates")
    where = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                f"/CN={ca}", "-keyout", where / f"{ca}.key", "-out", where / f"{ca}.crt")
    (where / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    signed: list[tuple[str, list[str | Path]]] = [
        ("broker", ["-extfile", where / "san.cnf"]), ("client", [])]
    for name, extra in signed:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", where / f"{name}.key", "-out", where / f"{name}.csr")
        openssl("x509", "-req", "-in", where / f"{name}.csr", "-CA", where / "ca.crt",
                "-CAkey", where / "ca.key", "-CAcreateserial", "-days", "2",
                "-out", where / f"{name}.crt", *extra)
    return where


class TlsListener:
    """A TLS (or mutual-TLS) listener on loopback that hands each connection's bytes to a
    plaintext broker and back: what a broker's SSL listener is, on the wire. Blocking
    sockets, one thread per connection owning its TLS socket: OpenSSL then sends its alerts
    (a missing client certificate) as a broker's TLS stack does, which asyncio's does not."""

    def __init__(self, backend_port: int, context: ssl.SSLContext) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._backend_port = backend_port
        self._context = context
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        self._server.settimeout(0.1)  # a closed socket does not wake a blocked accept()
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        client.settimeout(10)
        try:
            tls = self._context.wrap_socket(client, server_side=True)
        except OSError:  # the handshake failed, and the client was told why
            client.close()
            return
        tls.settimeout(None)
        try:
            backend = socket.create_connection(("127.0.0.1", self._backend_port))
        except OSError:  # the broker is not up yet, or stopped: the client sees a close
            tls.close()
            return
        with tls, backend:
            while True:
                readable = [tls] if tls.pending() else select.select([tls, backend], [], [])[0]
                try:
                    for source, sink in ((tls, backend), (backend, tls)):
                        if source in readable:
                            data = source.recv(65536)
                            if not data:
                                return
                            sink.sendall(data)
                except OSError:
                    return

    def __enter__(self) -> TlsListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(10)
        self._server.close()


def tansu(port: int, advertised: int, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [tansu_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}",
         "--storage-engine", "memory://tansu/", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def stopped(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_context(pki: Path, *, client_certificates: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki / "broker.crt", pki / "broker.key")
    if client_certificates:
        context.load_verify_locations(pki / "ca.crt")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@pytest.fixture(scope="module", params=["tls", "mutual-tls"])
def tls_kafka(request: pytest.FixtureRequest, pki: Path) -> Iterator[Settings]:
    """Settings of a client of the broker behind a TLS listener that trusts its CA (and
    presents the client certificate where the listener asks for one)."""
    mutual = request.param == "mutual-tls"
    backend = free_port()
    with TlsListener(backend, server_context(pki, client_certificates=mutual)) as listener:
        broker = tansu(backend, listener.port)
        try:
            kafka_settings = KafkaSettings(
                bootstrap_servers=f"127.0.0.1:{listener.port}", security_protocol="SSL",
                ssl_cafile=str(pki / "ca.crt"),
                **({"ssl_certfile": str(pki / "client.crt"),
                    "ssl_keyfile": str(pki / "client.key")} if mutual else {}))
            settings = Settings(kafka=kafka_settings, topic_prefix=f"tls{listener.port}")
            asyncio.run(kafka.wait_for_broker(settings, 30))
            yield settings
        finally:
            stopped(broker)


@pytest.fixture(scope="module")
def scram_kafka() -> Iterator[Settings]:
    """Settings of a SCRAM-SHA-512 client of a broker that knows no such user."""
    port = free_port()
    broker = tansu(port, port, "--authentication")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), 0.2):
                    break
            except OSError:
                time.sleep(0.05)
        yield Settings(kafka=KafkaSettings(
            bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512", sasl_username="gpusteward",
            sasl_password=PASSWORD))
    finally:
        stopped(broker)


def environment(settings: Settings, **extra: str) -> dict[str, str]:
    """The variables a pod's ConfigMap and Secret give a process for these settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUSTEWARD_")}
    kafka_settings = settings.kafka
    values = {"BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
              "SECURITY_PROTOCOL": kafka_settings.security_protocol,
              "SASL_MECHANISM": kafka_settings.sasl_mechanism,
              "SASL_USERNAME": kafka_settings.sasl_username,
              "SASL_PASSWORD": (kafka_settings.sasl_password.get_secret_value()
                                if kafka_settings.sasl_password else None),
              "SSL_CAFILE": kafka_settings.ssl_cafile,
              "SSL_CERTFILE": kafka_settings.ssl_certfile,
              "SSL_KEYFILE": kafka_settings.ssl_keyfile}
    return {**clean, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix, **extra,
            **{f"GPUSTEWARD_KAFKA__{k}": v for k, v in values.items() if v is not None}}


def start_refused(tmp_path: Path, settings: Settings, *argv: str
                  ) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-P", "-m", "gpusteward.cli", *argv],
                            env=environment(settings), cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    return result, time.monotonic() - started


def with_kafka(settings: Settings, **changes: object) -> Settings:
    kafka_settings = settings.kafka.model_copy(update=changes)
    return settings.model_copy(update={"kafka": kafka_settings})


def test_every_client_kind_works_over_tls(tls_kafka):
    """The helpers every consumer, sink, the executor, the watcher and the lag reader
    build their clients with: topics created, a record sent and read back, a lag read."""
    settings = tls_kafka

    async def round_trip() -> None:
        await kafka.ensure_topics(settings, [topics.FINDINGS])
        name = topics.FINDINGS.name(settings)
        producer = kafka.producer(settings)
        await producer.start()
        try:
            await (await producer.send(name, b"{}", key=b"node-a"))
        finally:
            await producer.stop()
        records = await kafka.read_all(settings, name)
        assert [record.value for record in records] == [b"{}"]
        offsets = await kafka.group_offsets(settings, "nobody", [name])
        assert sum(end for end, _ in offsets.values()) == 1

    asyncio.run(round_trip())


def test_the_stream_worker_becomes_ready_over_tls(tls_kafka, tmp_path):
    """The worker as its StatefulSet runs it: Faust's consumer, producer and topic creation
    and the worker's own clients all cross the TLS listener (a plaintext one among them
    would never complete its handshake, and the worker would never be ready)."""
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-P", "-m", "gpusteward.cli", "worker", "--datadir",
         str(tmp_path / "data")],
        env=environment(tls_kafka, GPUSTEWARD_HEALTH_PORT=str(port)), cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while probe(port) != 200:
            assert worker.poll() is None, worker.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the worker did not become ready in 60 s"
            time.sleep(0.5)
    finally:
        worker.terminate()
        worker.communicate(timeout=30)


def test_an_untrusted_broker_certificate_stops_the_start_naming_the_ca_setting(
        tls_kafka, pki, tmp_path):
    wrong_ca = with_kafka(tls_kafka, ssl_cafile=str(pki / "other-ca.crt"))
    result, took = start_refused(tmp_path, wrong_ca, "alerts")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: Kafka at {tls_kafka.kafka.bootstrap_servers}: its TLS "
                           "certificate is not trusted")
    assert f"GPUSTEWARD_KAFKA__SSL_CAFILE={pki / 'other-ca.crt'}" in line
    assert took < 15

    async def refused() -> ConfigError | None:
        return await kafka.refusal(with_kafka(tls_kafka, ssl_cafile=None))

    assert "GPUSTEWARD_KAFKA__SSL_CAFILE is unset" in str(asyncio.run(refused()))


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SASL_PLAINTEXT"])
def test_a_plaintext_client_on_a_tls_listener_is_told_to_speak_tls(tls_kafka, tmp_path,
                                                                   protocol):
    """The commonest slip on a Strimzi or MSK TLS listener (port 9093 or 9094): the
    protocol left at its default. The TCP connection opens, the listener drops the request
    as a malformed handshake, and the process said only "did not answer" after its whole
    start timeout."""
    plain = with_kafka(tls_kafka, security_protocol=protocol, ssl_cafile=None,
                       ssl_certfile=None, ssl_keyfile=None,
                       **({"sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "gpusteward",
                           "sasl_password": SecretStr(PASSWORD)} if "SASL" in protocol else {}))
    result, took = start_refused(tmp_path, plain, "alerts")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    wanted = "SASL_SSL" if "SASL" in protocol else "SSL"
    assert line.startswith(f"error: Kafka at {tls_kafka.kafka.bootstrap_servers} speaks TLS "
                           f"on this port, and GPUSTEWARD_KAFKA__SECURITY_PROTOCOL={protocol}")
    assert f"set it to {wanted}" in line and PASSWORD not in result.stderr
    assert took < 15


def test_a_plaintext_broker_is_never_refused_as_tls(settings):
    """The probe runs only after a plaintext request went unanswered: a plaintext broker
    that answers is no refusal, one that is down is an outage, not TLS."""
    assert asyncio.run(kafka.refusal(settings)) is None
    gone = with_kafka(settings, bootstrap_servers=f"127.0.0.1:{free_port()}")
    assert asyncio.run(kafka.refusal(gone)) is None


@pytest.mark.parametrize("tls_kafka", ["mutual-tls"], indirect=True)
def test_a_listener_that_wants_a_client_certificate_names_the_certificate_setting(tls_kafka):
    anonymous = with_kafka(tls_kafka, ssl_certfile=None, ssl_keyfile=None)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="GPUSTEWARD_KAFKA__SSL_CERTFILE"):
        asyncio.run(kafka.wait_for_broker(anonymous, 30))
    assert time.monotonic() - started < 10


def test_a_refused_password_stops_the_start_at_once_and_is_never_printed(
        scram_kafka, tmp_path):
    result, took = start_refused(tmp_path, scram_kafka, "alerts")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: Kafka at {scram_kafka.kafka.bootstrap_servers} refused "
                           "the SASL login")
    for named in ("GPUSTEWARD_KAFKA__SASL_USERNAME=gpusteward",
                  "GPUSTEWARD_KAFKA__SASL_PASSWORD", "SCRAM-SHA-512"):
        assert named in line
    assert PASSWORD not in result.stdout + result.stderr
    assert took < 15


def test_a_collector_says_why_kafka_refuses_it_while_it_buffers(scram_kafka, tmp_path):
    """A collector keeps collecting through a Kafka outage; a refused login is not one,
    and its log says so, naming the settings, within seconds."""
    log = tmp_path / "collector.log"
    with log.open("w") as out:
        collector = subprocess.Popen(
            [sys.executable, "-P", "-m", "gpusteward.cli", "collect", "dcgm", "--node", "n1",
             "--url", f"http://127.0.0.1:{free_port()}/metrics"],
            env=environment(scram_kafka), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while "refused the SASL login" not in log.read_text():
            assert collector.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        collector.terminate()
        collector.wait(30)
    output = log.read_text()
    assert "GPUSTEWARD_KAFKA__SASL_PASSWORD" in output and PASSWORD not in output


def test_tls_files_under_a_protocol_without_tls_are_refused(pki):
    with pytest.raises(ValueError, match=re.escape(
            "kafka.ssl_cafile set but security_protocol is PLAINTEXT, which uses no TLS")):
        KafkaSettings(ssl_cafile=str(pki / "ca.crt"))
    with pytest.raises(ValueError,
                       match=re.escape("ssl_certfile and kafka.ssl_keyfile go together")):
        KafkaSettings(security_protocol="SSL", ssl_certfile=str(pki / "client.crt"))


def test_a_key_that_does_not_match_the_certificate_names_the_files(pki):
    mismatched = KafkaSettings(security_protocol="SSL", ssl_certfile=str(pki / "client.crt"),
                               ssl_keyfile=str(pki / "broker.key"))
    with pytest.raises(ConfigError, match=r"GPUSTEWARD_KAFKA__SSL_CERTFILE=\S+, "
                                          r"GPUSTEWARD_KAFKA__SSL_KEYFILE=\S+: not usable"):
        mismatched.aiokafka_config()
    with pytest.raises(ConfigError, match="not usable"):
        mismatched.faust_credentials()


@pytest.mark.skipif("GPUSTEWARD_TEST_KAFKA_SASL" not in os.environ, reason=(
    "needs a cluster that knows the user: Tansu's memory store holds none, and creating "
    "one needs a login; set GPUSTEWARD_TEST_KAFKA_SASL=1 with GPUSTEWARD_KAFKA__* "
    "pointing at a SASL listener"))
def test_a_scram_login_a_real_cluster_accepts():
    settings = Settings()
    assert settings.kafka.security_protocol.startswith("SASL_")

    async def login() -> None:
        await kafka.wait_for_broker(settings, 30)
        assert await kafka.refusal(settings) is None
        await kafka.list_topics(settings)

    asyncio.run(login())


def test_doctor_reports_the_refusal_as_a_failed_check(scram_kafka):
    from gpusteward.cli.doctor import check_kafka

    started = time.monotonic()
    (check,) = asyncio.run(check_kafka(scram_kafka, 30))
    assert not check.ok
    assert "refused the SASL login" in check.detail and PASSWORD not in check.detail
    assert time.monotonic() - started < 10
