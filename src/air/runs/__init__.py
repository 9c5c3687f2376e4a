"""Runs: the run controller and everything that drives a run (submit, admission, the supervisor, sweeps,
cancel, preemption, retries, reasons). Internal to air; the store it drives is air.store, the read side
air.views. Nothing is imported here.
"""
