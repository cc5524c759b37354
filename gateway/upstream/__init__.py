"""The lean keep-alive HTTP/1.1 client for upstream calls."""
