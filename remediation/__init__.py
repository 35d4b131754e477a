"""Remediation: actions to dry-run reviews or a cluster, behind guards, a breaker and an audit."""
