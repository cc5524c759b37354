"""Tenants: API keys, priority ceilings, quotas and the quota stage."""
