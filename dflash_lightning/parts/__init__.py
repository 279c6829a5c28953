"""Drafter parts (parts/base.py says what a part is) and the presets that name the variants (parts/presets.py)."""
