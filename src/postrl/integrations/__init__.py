"""Adapters that run postrl's stages inside other trainers.

- :mod:`postrl.integrations.verl`: the verl plug-in (``pip install postrl[verl]``): postrl's advantage estimators
  and policy losses in verl's registries, a verl reward function running postrl's reward sources and shaping,
  postrl's diagnostics on verl's batch; ``postrl export verl RUN.yaml`` writes the matching verl command line.
"""
