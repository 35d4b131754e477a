"""Alerting: findings to the console, Alertmanager and chat webhooks."""
