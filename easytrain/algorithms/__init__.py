"""Algorithms: advantage estimators, KL penalties and policy losses as pure tensor functions."""
