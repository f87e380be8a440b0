"""The trainer's ground floor: what every role reads (config, run directory, control, the file
formats) and the operator side may import too. Torch-free; imports nothing above it."""
