"""Checks and cost tools: coverage and its evidence, the kernels' cost, the gates, cleaning up."""
