"""Checkpoints: DCP save/load/prune of a run's state (``store``), choosing and checking the one to
resume from (``resume``), and loading a pretrained base model for fusion (``base``)."""
