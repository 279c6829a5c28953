"""The life of a long run: atomic writes, checkpoints and their rotation, automatic resume, preemption and requeue
(docs/long-runs.md, docs/checkpoints.md).
"""
