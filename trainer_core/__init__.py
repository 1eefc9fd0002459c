"""loraloom worker pool: multi-adapter LoRA training of many runs in the same passes.

Never imports fastapi or sqlalchemy. This __init__ stays import-free so that the
service can import the torch-free modules (config, wire) without loading torch.
"""
