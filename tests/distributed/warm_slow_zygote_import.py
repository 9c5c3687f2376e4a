"""Preloading this module takes 15 s: a zygote still importing for longer than the hang timeout of
tests/distributed/test_stacks_parallel.py's call (whose ranks are not hung: they do not exist yet)."""

import time

time.sleep(15)
