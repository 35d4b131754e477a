"""``python -m gpusteward.cli``: the same entry point as the ``gpusteward`` script."""

from gpusteward.cli import main

main()
