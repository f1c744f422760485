"""ups-blocks: a ups sampler that gives each rank one contiguous block of the data."""
