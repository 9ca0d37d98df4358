"""Fault-injection scenarios (pytest marker `faults`): kill -9, broker outages, database restarts."""
