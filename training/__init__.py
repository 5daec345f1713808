"""SFT data from trajectories, LoRA training (peft), and the adapter registry (MLflow)."""
