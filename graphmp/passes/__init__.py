"""The conversion passes, in pipeline order: prepare, types, calibrate, classify, paint, apply."""
