"""What every model family shares: checkpoint IO (checkpoint), the quantization spec (config),
the float and WNA16 layers (modules), the decode loop and sampling (generate), the tokenizers
and chat templates (tokenizer) and the sharding base (sharding). A family is then a config, a
modeling file, a checkpoint name table and its sharding specs."""
