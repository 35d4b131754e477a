"""The fleet simulator: deterministic scenarios that publish what real collectors publish."""
