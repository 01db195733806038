"""The rollout role: generation engines behind one interface, and the worker that hosts one."""
