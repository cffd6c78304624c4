"""Trainer batching: BatchedDataDict, sequence packing, DP split planning, padding."""
