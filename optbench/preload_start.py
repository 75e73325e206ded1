"""Imported first by the workers' forkserver (``optbench.forkserver``): the collector off while the
server imports torch and the trainer (``optbench.collector`` says why); ``optbench.preload_done``,
imported last, freezes what was imported and turns it back on."""

import gc

gc.disable()
