"""The simple/complex request classifier: features, cues, weights (trained offline by training/)."""
