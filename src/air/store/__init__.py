"""The run store and what it holds: the SQLite ledger of runs and attempts (WAL), their states, the names
of every file of a run folder, who may see a run. Below the run controller (air.runs), the read side
(air.views) and every backend; nothing is imported here, so `air.store.paths` stays cheap to import.
"""
