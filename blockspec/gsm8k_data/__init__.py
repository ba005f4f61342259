"""Procedural GSM8K-format math word problems for the demo family: ``templates`` (the problem
kinds), ``generator`` (seeded, disjoint splits, jsonl), ``tokenizer`` (digit-level BPE)."""
