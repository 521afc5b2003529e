"""rackserve: serve DeepSeek-V4-family MoE models across GPU racks on Ray."""

__version__ = "0.1.0"
