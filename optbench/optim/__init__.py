"""Optimizations, one ``apply_<concern>`` or ``build_<thing>`` each; ``optbench.parallelize`` is the
only place that knows their order."""
