"""Prefect flows: each file is one flow that only calls tasks from ``tasks/``."""
