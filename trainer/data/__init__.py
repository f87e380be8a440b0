"""Chat data: reading and validating conversations, tokenizing with loss masks, bucketed and
packed batches, the data report, synthetic data."""
