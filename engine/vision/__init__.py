"""Images in: Qwen3.5's vision tower and what serves it (config, preprocessing, the tower, its weights, the
language model's multimodal rotary positions and the splice of image embeddings into a prompt)."""
