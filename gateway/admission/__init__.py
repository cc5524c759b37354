"""Admission control: the process-wide gate with its fair priority queue, and the admission stage."""
