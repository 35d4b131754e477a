"""The Strimzi KafkaTopic objects match the topic registry (gpusteward/topics.py).

Names with the default prefix, partitions (node-keyed topics share
kafka.node_partitions), cleanup policy and retention must be the ones
`ensure_topics` would create, so the two ways of creating topics cannot drift.
"""

from __future__ import annotations

import re

import pytest

from gpusteward import topics
from gpusteward.settings import Settings
from tests.deploy.conftest import REPO

pytestmark = pytest.mark.deploy

FAUST_CHANGELOG = "gpusteward-worker-node-state-changelog"


def test_kafka_topics_match_the_registry(render):
    rendered = render("production")
    settings = Settings()
    declared = {t["spec"]["topicName"]: t for t in rendered.kind("KafkaTopic")}
    expected = {spec.name(settings): spec for spec in topics.ALL}
    assert set(declared) == set(expected) | {FAUST_CHANGELOG}
    for name, spec in expected.items():
        topic = declared[name]
        assert topic["metadata"]["name"] == name
        assert topic["spec"]["partitions"] == spec.partition_count(settings), name
        config = {k: str(v) for k, v in topic["spec"]["config"].items()}
        assert config == spec.config(), name


def test_changelog_is_compacted_and_co_partitioned(render):
    rendered = render("production")
    (changelog,) = [t for t in rendered.kind("KafkaTopic")
                    if t["spec"]["topicName"] == FAUST_CHANGELOG]
    assert {k: str(v) for k, v in changelog["spec"]["config"].items()} == {
        "cleanup.policy": "compact", **topics.COMPACTED_SEGMENTS}
    assert changelog["spec"]["partitions"] == Settings().kafka.node_partitions


def test_topics_are_replicated_and_belong_to_one_cluster(render):
    rendered = render("production")
    kafka_objects = rendered.kind("KafkaTopic") + rendered.kind("KafkaUser")
    assert {t["metadata"]["labels"]["strimzi.io/cluster"] for t in kafka_objects} == {"kafka"}
    assert {t["metadata"]["namespace"] for t in kafka_objects} == {"kafka"}
    assert {t["spec"]["replicas"] for t in rendered.kind("KafkaTopic")} == {3}
    # Workers create topics with the same replication the KafkaTopics declare.
    kafka_env = next(c for c in rendered.kind("ConfigMap")
                     if c["metadata"]["name"].startswith("gpusteward-kafka"))
    assert kafka_env["data"]["GPUSTEWARD_KAFKA__REPLICATION_FACTOR"] == "3"


def test_kafka_user_reaches_only_gpusteward_topics_and_groups(render):
    (user,) = render("production").kind("KafkaUser")
    assert user["spec"]["authentication"]["type"] == "scram-sha-512"
    resources = {(acl["resource"]["type"], acl["resource"]["name"], acl["resource"]["patternType"])
                 for acl in user["spec"]["authorization"]["acls"]}
    assert resources == {("topic", "gpusteward", "prefix"), ("group", "gpusteward", "prefix")}
    for acl in user["spec"]["authorization"]["acls"]:
        assert "All" not in acl["operations"] and "Delete" not in acl["operations"]


def test_the_documented_wait_selects_gpusteward_topics_alone(render):
    """Step 4 waits for the topics: by the cluster's label it would wait for every topic
    of a shared Kafka cluster, other teams' included (one of theirs not Ready fails the
    install), so it selects by gpusteward's own label, which every KafkaTopic carries."""
    text = (REPO / "docs" / "deploy.md").read_text()
    waits = re.findall(r"kubectl -n kafka wait (kafkatopic|kafkauser)\S* (-l \S+|\S+)", text)
    assert ("kafkatopic", "-l app.kubernetes.io/part-of=gpusteward") in waits
    assert all(selector != "-l strimzi.io/cluster=kafka" for _, selector in waits)
    for topic in render("production").kind("KafkaTopic"):
        assert topic["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpusteward"
