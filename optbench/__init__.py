"""optbench: turn a training-optimization plan into measured evidence."""

__version__ = "0.1.0"
