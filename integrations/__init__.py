"""Integrations with trainers: ``fsdp_plugin.integrations.lightning`` and ``fsdp_plugin.integrations.accelerate``."""
