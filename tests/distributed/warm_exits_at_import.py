"""Preloading this module kills the process that imports it (a zygote that dies before forking)."""

import os
import sys

sys.stderr.write("warm_exits_at_import: giving up\n")
sys.stderr.flush()
os._exit(7)
