"""Choosing a schedule: heuristics, the CP-SAT model, and the solve loop that checks
every candidate with the simulator."""
