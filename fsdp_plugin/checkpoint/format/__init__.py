"""The checkpoint format: manifest, safetensors headers, codec, layouts, byte-exact writer and reader."""
