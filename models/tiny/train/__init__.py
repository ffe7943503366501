"""Training of the bundled tiny pair (`python -m models.tiny.train`; not installed)."""
