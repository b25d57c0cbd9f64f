"""Saving a step: the save session, the Orbax handler, the writing of one step and its
commit, save telemetry, and the exit hook that commits a save still in flight.
"""
