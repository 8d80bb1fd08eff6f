"""What every model family shares: the causal-LM base (causal_lm), the loader engine (loader),
checkpoint IO (checkpoint), the quantization spec (config), the float and WNA16 layers
(modules), the decode loop and sampling (generate), the tokenizers and chat templates
(tokenizer) and the sharding base (sharding). A family is then a config, a modeling file of
what differs, a checkpoint name table and its sharding specs (docs/design.md, 'Adding a model
family')."""
