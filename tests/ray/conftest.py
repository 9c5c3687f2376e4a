"""tests/ray run on the session's Ray cluster (`ray_cluster`, tests/conftest.py), shared with the seeds."""

from __future__ import annotations
