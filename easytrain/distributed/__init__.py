"""Distributed: starting or joining Ray, resource pools, worker groups, FSDP."""
