"""What becomes of logits: sampling parameters and samplers, structured output (grammars), the
tokenizer and incremental detokenization."""
