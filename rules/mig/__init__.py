"""MIG geometry and layout advice.

:mod:`geometry` knows which sets of GPU instances each GPU model can hold
(from the shipped ``mig_profiles.yaml``); :mod:`layout` chooses per-pool
layouts for the week's demand and writes them as a mig-parted config.
"""
