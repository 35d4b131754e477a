"""Test doubles of the systems gpusteward talks to, importable by every test suite."""
