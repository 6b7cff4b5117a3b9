"""gpt_tp: tensor-parallel GPT-2 training on PyTorch Lightning."""
