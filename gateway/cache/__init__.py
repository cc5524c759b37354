"""The response cache: keys and entries, single flight in and across processes, the cache stage."""
