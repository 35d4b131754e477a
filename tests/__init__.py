"""gpusteward's tests, one package per area (so each area may have its own conftest)."""
