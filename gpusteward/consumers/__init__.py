"""Consumers of the output topics: alerting and remediation."""
