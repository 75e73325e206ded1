"""Models: optbench's own transformer (``transformer``), climate-text fusion layers (``fusion``) and
the fused model built from a base (``fused``)."""
