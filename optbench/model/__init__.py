"""Models: optbench's own transformer (``transformer``) and the climate-text fusion layers
(``fusion``); what a run does with a fused model (its base checkpoint, its FLOPs) is
``optbench.training.fused``."""
