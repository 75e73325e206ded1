"""Datasets and loaders: synthetic tokens, token files, and the sampler that shards and resumes."""
