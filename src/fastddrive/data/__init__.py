"""Driving samples: the sample type and its storage, and the simulator that makes them."""
