"""Data: datasets, images and vision-token bookkeeping, synthetic tasks."""
