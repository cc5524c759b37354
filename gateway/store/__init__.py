"""The Store the cache, quotas and affinity sit on: in memory, or Redis."""
