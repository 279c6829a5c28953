"""Prompts at scale for regenerate, built offline from what the machine holds (docs/prompts.md): one module per
source, build.py dedups them, holds out a split of each and writes the files with their manifest.
"""
