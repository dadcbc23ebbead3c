"""Routing: prompt vectors clustered into anchors (router), the bank of per-cluster drafting
configurations (bank) and its pictures. Imports the engine and the base modules only."""
