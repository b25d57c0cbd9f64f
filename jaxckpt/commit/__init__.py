"""The commit-marker protocol: markers, writer epochs, agreement among hosts, garbage collection.

A step becomes visible only once all of its data is durable on every host; nothing here
relies on rename. Imports no jax, so listing tools start fast.
"""
