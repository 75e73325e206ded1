"""Imported last by the workers' forkserver (``optbench.forkserver``): what the server imported is
frozen (never garbage; its workers then never touch those pages in a collection) and the collector,
off since ``optbench.preload_start``, is on again."""

import gc

from optbench.collector import freeze_once

freeze_once()
gc.enable()
