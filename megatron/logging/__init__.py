from megatron.logging.metrics import MetricsWriter, ProgressLine, format_bytes

__all__ = ["MetricsWriter", "ProgressLine", "format_bytes"]
