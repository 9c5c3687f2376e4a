"""Runs: the run store (SQLite, WAL), run and attempt states, run folders, termination reasons, log tails,
and the run controller. Internal to air (the CLI, the supervisor and the backends import its modules);
users meet it through `air` commands. Nothing is imported here: a `@distributed` call imports
`air.runs.paths` on its path and must not pay for the store, the reasons' regexes and the rest with it.
"""
