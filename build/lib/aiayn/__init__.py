"""aiayn: a workflow-orchestrated reproduction of "Attention Is All You Need"."""

__version__ = "0.1.0"
