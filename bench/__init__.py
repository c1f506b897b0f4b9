"""bench — the project's performance figures, each a ratio measured side by side (``python -m bench``)."""
