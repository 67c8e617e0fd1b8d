"""Supervised fine-tuning on the RL policy (`mcore-rl-sft`, docs/sft.md): the cold start RL continues from."""
