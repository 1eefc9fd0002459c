"""loraloom control plane (FastAPI). Never imports torch."""
