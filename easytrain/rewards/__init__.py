"""Rule rewards: pure functions of response text and ground truth, and their registry."""

from easytrain.rewards.registry import REGISTRY, Reward, RewardFn, RewardLoadError, load_function, register

__all__ = ["REGISTRY", "Reward", "RewardFn", "RewardLoadError", "load_function", "register"]
