"""The configuration, beside the layers and read by all of them: the typed sections, TOML files
and overrides (schema.py), the values a key may take (choices.py), the checks of what the config
alone decides (checks_layout.py: the model and layout; checks_train.py; checks_hf.py: a Hugging
Face folder), where a run's files can be made (paths.py). docs/design.md maps them."""
