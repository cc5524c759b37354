"""The request pipeline: the Call record and the stage list (core.py), intake, pinning."""
