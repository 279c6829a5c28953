"""Code that runs inside a vLLM engine (its own venv), never in the trainer: the hidden-states KV connector.

Nothing here imports the rest of the package, so `vllm serve` imports it with only the repository on its path.
"""
