"""postrl's stages inside other trainers. Each is imported only when used: ``import postrl`` imports neither TRL nor
verl.

- :mod:`postrl.integrations.trl`: a TRL ``GRPOTrainer`` subclass (``pip install postrl[trl]``) running postrl's
  rewards (fault isolation), shaping, keep-mask filters, advantage estimator, objective and diagnostics.
- :mod:`postrl.integrations.verl`: the verl plug-in (``pip install postrl[verl]``): postrl's advantage estimators
  and policy losses in verl's registries, a verl reward function running postrl's reward sources and shaping,
  postrl's diagnostics on verl's batch; ``postrl export verl RUN.yaml`` writes the matching verl command line.
- :mod:`postrl.integrations.alarms`: postrl's alarms inside plain TRL and verl, no postrl stage: a TRL
  ``TrainerCallback`` (``AlarmCallback``, needs only transformers) and, for verl, a function over each step's
  metrics dict (``verl_step``) with a hook on verl's logger (``install_verl``).
"""
