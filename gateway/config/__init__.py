"""Configuration: the policy file, the Runtime built from it, hot reload."""
