"""Checkpoints: one ``Manager`` per run (plan, resume, save, prune; ``manager``) over DCP storage
(``store``) and the rules of resuming (``resume``); beside it, loading a pretrained base model for
fusion (``base``)."""

from optbench.checkpoint.manager import Manager, Plan, agreed_plan, plan

__all__ = ["Manager", "Plan", "agreed_plan", "plan"]
