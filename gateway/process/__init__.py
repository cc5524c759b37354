"""Process plumbing: serve (one worker or a supervisor over N), launched local backends, the control channel, peers."""
