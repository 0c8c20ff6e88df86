"""The reference on-policy distillation (OPD) loop: tasks, engines, losses, trainer."""
