"""Model files: our config.json + model.safetensors, the original options.json + HDF5, shape checks
before allocation, and atomic publishing. Never imports the model class; it is handed in.
"""
