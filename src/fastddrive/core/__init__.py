"""What every layer shares: the driving answer schema, scaffold layouts, the prompt, tokens, the sample type and
its constants, the trajectory metrics, and the rules for inputs, outputs and memory. Imports nothing above it."""
