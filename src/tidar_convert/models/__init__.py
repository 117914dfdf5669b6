"""The base model: loading a checkpoint (hub id, folder or GGUF), the attention families TiDAR
converts or refuses, model-file checks, and LoRA adapters on it. Imports only runtime/."""
