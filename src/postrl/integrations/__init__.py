"""postrl's stages inside other trainers: ``postrl.integrations.trl`` (a TRL ``GRPOTrainer`` subclass, extra
``postrl[trl]``) and ``postrl.integrations.verl`` (a verl plug-in, extra ``postrl[verl]``). Each is imported only
when used: ``import postrl`` imports neither TRL nor verl."""
