"""The swarm dashboard: a read-only web page (``static/``) and the HTTP server that serves it with the swarm as JSON
(``server.py``). The server needs only the standard library; the page ships all its assets (no CDN, no framework)."""

from p2ptrain.observe.dashboard.server import DashboardServer

__all__ = ["DashboardServer"]
