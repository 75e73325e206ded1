"""Running: ``optbench train`` (``command``), ``train(cfg)`` (one measured run), Hydra sweeps,
preemption signals, and the loop as components (``loop/``)."""
