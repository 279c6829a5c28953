"""Speculative decoding with a drafter: the decoder (speculative.py), `evaluate` (evaluate.py), and the served-tau
validation callback of a training run (validation.py); docs/method.md sections 8 and 10.
"""
