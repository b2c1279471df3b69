"""Model definitions and HF checkpoint I/O."""
