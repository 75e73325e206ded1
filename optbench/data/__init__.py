"""Datasets and loaders: synthetic tokens, token files, and the sampler that shards and resumes;
climate files (``netcdf/``), captions and paired text; ``optbench data`` (``command``)."""
