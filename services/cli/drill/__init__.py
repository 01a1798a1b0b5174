"""Failover drills: generate multi-turn load, inject a real fault, observe, report, check SLOs."""
