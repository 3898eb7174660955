"""Native kernels for CPU hot spots, compiled at first use; torch implementations stay the fallback."""
