"""The web console of the admin plane: static files (index.html, app.js, app.css, favicon.ico)
served under /console with a strict CSP; everything it shows comes from the /admin API."""

from .routes import routes

__all__ = ["routes"]
