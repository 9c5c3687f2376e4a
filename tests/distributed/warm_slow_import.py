"""Preloading this module takes a minute (a zygote still importing when the call is ended)."""

import time

time.sleep(60)
