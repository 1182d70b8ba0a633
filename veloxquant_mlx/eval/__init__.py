"""Evaluation and benchmark harness (``veloxquant eval`` / ``veloxquant bench``).

- ``text``: the default English corpus (standard-library docstrings) and token windows.
- ``perplexity``: ``perplexity_through_cache``, ``forward_perplexity``,
  ``evaluate_methods`` (the method table).
- ``retrieval``: passkey, needle (single / multi-key) and key-value retrieval.
- ``bench``: prefill / decode speed and memory vs dense at several contexts.
- ``sweep``: quality + speed for a list of settings, written as JSON, Markdown, PNG.
- ``report``: Markdown tables, run records, the memory-vs-perplexity plot.
"""
