"""The upstream call: attempts, the streaming pump, failover, retries, hedging, rescue, reports."""
