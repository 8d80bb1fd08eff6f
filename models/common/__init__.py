"""What every model family shares: the tokenizers and chat templates (tokenizer)."""
