"""Workers: the roles (actor, reference, rollout) and the reward pool."""
