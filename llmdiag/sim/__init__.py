"""Simulation: the engine model shared by the fake engine (wall clock) and the cluster simulator (virtual clock)."""
