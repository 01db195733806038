"""A reward that spreads scores over any responses, so every GRPO step of a random tiny model has
non-zero advantages and really changes the weights (the resume tests compare weights)."""


def spread(responses: list[str], ground_truths: list[str]) -> list[dict[str, float]]:
    return [{"overall": (sum(map(ord, r)) % 7) / 6.0} for r in responses]
