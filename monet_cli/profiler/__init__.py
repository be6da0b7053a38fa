"""Profile a real training step: capture its ops and memory, time them, write a Profile."""
