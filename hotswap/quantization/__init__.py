"""Quantized weights (FP8): their configuration and the quantizer itself, below the model."""
