"""air's web pages: runs, one run (attempts, live logs, spec, charts, cancel), capacity, login.

Served by `air ui` (loopback, no login) and mounted by `air server` (its tokens). `create_web_app` is the
one entry point; the data comes from `air.views.query`.
"""

from __future__ import annotations

from air.web.app import create_web_app
from air.web.auth import Authenticator, WebUser

__all__ = ["Authenticator", "WebUser", "create_web_app"]
