"""Hugging Face safetensors import / export (and ranged writes of one shared file)."""
