"""easytrain: RL (GRPO and relatives) and SFT for vision-language models on Ray."""

__version__ = "0.1.0"
