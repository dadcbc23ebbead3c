"""Thin Prefect task wrappers around knnssd's calibration and generation steps."""
