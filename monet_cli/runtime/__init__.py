"""Torch-facing runtime: the memory meter now, the schedule executor later."""
