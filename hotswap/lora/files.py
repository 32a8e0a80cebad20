"""The two files of a PEFT LoRA adapter directory, named once for every reader."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
