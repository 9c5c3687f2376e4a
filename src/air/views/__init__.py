"""The read side: what `air list/get/logs`, the server's API and the pages show of a run (air.views.query),
its live follow streams (follow, fanout) and log tails. Reads the store (air.store); starts nothing.
"""
