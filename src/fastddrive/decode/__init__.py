"""Decoders: each turns a prompt into response token ids with the model's heads."""
