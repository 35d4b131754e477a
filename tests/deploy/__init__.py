"""Checks of deploy/, docker-compose.yml and the Dockerfile."""
