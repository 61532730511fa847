"""Loading: checkpoints (safetensors, GGUF), packed quantized weights, named models, tokenizers, memory."""
