"""``optbench generate``: text from a trained ``task=climate_text`` model, for the climate of a time
or of eval samples — with the true climate, a shuffled one or none (the base alone) — and the
numbers it writes scored against the field (``score``). ``load`` rebuilds a run's model from its
checkpoint, ``decode`` writes the text; ``api`` is what the command (``command``) calls."""
