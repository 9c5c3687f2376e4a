"""`air server`: one long-lived process that owns a run store, starts every run's supervisor next to it,
and serves an HTTP API (and, mounted into its app, web pages) to a team.

A top layer beside the CLI: it may import runs, workload, backends and tracking; nothing imports it but
the CLI's `air server` command. The CLI reaches it through `air.client`.
"""
