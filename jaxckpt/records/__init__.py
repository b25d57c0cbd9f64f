"""What a root holds, as records: the storage keys, the commit marker and manifest parts,
the tree record, per-process state, and the names read back from them (checked).
"""
