"""Tools over committed steps: copy, verify, diff, stats, and import/export to Orbax and
safetensors.
"""
