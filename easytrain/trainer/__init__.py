"""Trainers: the RL loop (single controller), metrics and timing."""
