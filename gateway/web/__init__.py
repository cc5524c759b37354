"""The HTTP edge: the app and its routes, handlers, bounded bodies, sinks, drain."""
