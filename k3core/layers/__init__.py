"""nn.Modules of the K3 model; parameter names mirror the released Hugging Face tensor names."""
