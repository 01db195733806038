"""Memory: the planner (what every role will need, before launch) and, later, the watchdog."""
